"""scripts/train.sh and scripts/test.sh as a newcomer meets them, run with a stand-in Python that records
what it is asked to do: the one-line refusals before pip runs, and recovery from a failed install."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_offload.config.files import NO_CUDA

ROOT = Path(__file__).resolve().parents[1]
HAS_NVIDIA_DRIVER = shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/version").exists()

FAKE_PYTHON = """#!/bin/sh
# Records each call; answers as a Python $FAKE_VERSION would; pip exits with $PIP_STATUS.
echo "$*" >> "$LOG"
case "$*" in
  *"print("*) echo "$FAKE_VERSION" ;;
  *"sys.exit(sys.version_info < (3, 12))"*) [ "$FAKE_VERSION" != "${FAKE_VERSION#3.12}" ] ;;
  "-m venv "*) mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && cp "$0" "$3/bin/ruff" ;;
  "-m pip install"*) exit "$PIP_STATUS" ;;
  "-m megatron_offload.config.files"*) echo "preflight stops here" >&2; exit 2 ;;
esac
"""


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return {
        **os.environ,
        "PYTHON": str(python),
        "VENV": str(tmp_path / "venv"),
        "LOG": str(tmp_path / "calls.log"),
        "FAKE_VERSION": "3.12.4",
        "PIP_STATUS": "0",
    }


def run_script(script: str, env: dict[str, str], **overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", f"scripts/{script}"], cwd=ROOT, env={**env, **overrides}, capture_output=True, text=True
    )


def calls(env: dict[str, str]) -> list[str]:
    log = Path(env["LOG"])
    return log.read_text().splitlines() if log.exists() else []


def test_train_sh_on_python_311_says_it_needs_312_in_one_line_before_pip(fake: dict[str, str]) -> None:
    result = run_script("train.sh", fake, FAKE_VERSION="3.11.9", SKIP_GPU_CHECK="1")  # a GPU machine
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "megatron-offload: the main job needs Python >= 3.12 (megatron-core >= 0.17, which ships Megatron-LM's "
        f"training loop, requires it); {fake['PYTHON']} is Python 3.11.9: run PYTHON=python3.12 bash scripts/train.sh\n"
    )
    assert not any("pip" in call or "venv" in call for call in calls(fake))


@pytest.mark.skipif(HAS_NVIDIA_DRIVER, reason="this machine has an NVIDIA driver")
def test_train_sh_without_a_gpu_says_so_in_one_line_before_installing(fake: dict[str, str]) -> None:
    result = run_script("train.sh", fake)
    assert result.returncode == 2
    assert result.stderr == NO_CUDA + "\n"  # the same line as the launcher's and the hooks'
    assert not any("pip" in call or "venv" in call for call in calls(fake))


def test_train_sh_installs_again_after_a_failed_install_and_not_after_a_good_one(fake: dict[str, str]) -> None:
    env = {**fake, "SKIP_GPU_CHECK": "1"}
    failed = run_script("train.sh", env, PIP_STATUS="1")
    assert failed.returncode == 1
    assert failed.stderr.splitlines()[-1].endswith(
        "failed (pip's message is above); run the same command again to retry"
    )
    assert not list(Path(env["VENV"]).glob(".installed-*"))
    again = run_script("train.sh", env)  # the venv's python exists now: it must not pass for installed
    assert "[2/3] installing" in again.stderr and "preflight stops here" in again.stderr
    assert again.returncode == 2
    assert len(list(Path(env["VENV"]).glob(".installed-*"))) == 1
    installs = sum("-m pip install" in call for call in calls(env))
    later = run_script("train.sh", env)
    assert "installing" not in later.stderr and sum("-m pip install" in call for call in calls(env)) == installs


def test_test_sh_installs_again_after_a_failed_install(fake: dict[str, str]) -> None:
    failed = run_script("test.sh", fake, PIP_STATUS="1")
    assert failed.returncode == 1 and "installing torch failed" in failed.stderr
    ok = run_script("test.sh", fake)
    assert ok.returncode == 0 and "[2/4] installing torch" in ok.stderr
    assert calls(fake)[-2:] == ["check .", "-m pytest"]  # ruff, then pytest, from the venv
    again = run_script("test.sh", fake)
    assert again.returncode == 0 and "installing" not in again.stderr


def test_ci_runs_the_readme_test_command() -> None:
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in (ROOT / "README.md").read_text()
