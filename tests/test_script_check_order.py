"""The shell scripts check before they act: train.sh names what no install can fix (no GPU) before what
one can (an older Python), and device_check.sh finds its wheels before it clears earlier results."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_offload.config.files import NO_CUDA

ROOT = Path(__file__).resolve().parents[1]
HAS_NVIDIA_DRIVER = shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/version").exists()

OLD_PYTHON = """#!/bin/sh
# A Python 3.11 that records each call.
echo "$*" >> "$LOG"
case "$*" in
  *"print("*) echo 3.11.9 ;;
  *"sys.exit(sys.version_info < (3, 12))"*) exit 1 ;;
esac
"""


@pytest.mark.skipif(HAS_NVIDIA_DRIVER, reason="this machine has an NVIDIA driver: the missing-GPU answer cannot show")
def test_train_sh_without_gpu_or_new_python_names_the_gpu_first(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(OLD_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "VENV": str(tmp_path / "venv"), "LOG": str(tmp_path / "calls")}
    env.pop("SKIP_GPU_CHECK", None)
    result = subprocess.run(["bash", "scripts/train.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr == NO_CUDA + "\n"
    assert not (tmp_path / "calls").exists()  # Python was not even asked its version


def device_check(tmp_path: Path, *versions: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    results = tmp_path / "device-results"
    results.mkdir()
    (results / "summary.txt").write_text("an earlier run's results\n")
    env = {**os.environ, "RESULTS": str(results), "PARTS": "tests"}
    result = subprocess.run(
        ["bash", "scripts/device_check.sh", *versions], cwd=ROOT, env=env, capture_output=True, text=True
    )
    return result, results


@pytest.mark.skipif(bool(list(ROOT.glob(".whl/mcore-*"))), reason="this checkout carries megatron-core wheels")
def test_device_check_without_wheels_keeps_earlier_results(tmp_path: Path) -> None:
    result, results = device_check(tmp_path)
    assert result.returncode == 2
    assert result.stdout.startswith("no megatron-core wheels under .whl/: run bash scripts/fetch_wheels.sh")
    assert (results / "summary.txt").read_text() == "an earlier run's results\n"


def test_device_check_with_a_version_it_has_no_wheel_for_keeps_earlier_results(tmp_path: Path) -> None:
    result, results = device_check(tmp_path, "0.0.0-none")
    assert result.returncode == 2
    assert "no megatron-core 0.0.0-none wheel under .whl/mcore-0.0.0-none/" in result.stdout
    assert (results / "summary.txt").read_text() == "an earlier run's results\n"
