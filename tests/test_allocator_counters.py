"""benchmarks/allocator_counters.py: the script runs with its own arguments, and the counters line comes last,
also when the script exits with an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.allocator_counters", str(script), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("code", [0, 3])
def test_the_script_runs_with_its_arguments_and_the_counters_come_last(tmp_path: Path, code: int) -> None:
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nprint('args', sys.argv[1:])\nsys.exit({code})\n")
    done = run(script, "--seed", "7")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == code
    assert lines[0] == "args ['--seed', '7']"
    assert lines[-1].startswith("allocator counters: ")
    import torch

    if not torch.cuda.is_available():
        assert lines[-1] == "allocator counters: no CUDA GPU"
    else:
        assert '"num_alloc_retries": 0' in lines[-1]  # a script that allocates nothing never retries


def test_no_script_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.allocator_counters"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and done.stderr.strip().startswith("usage:")
