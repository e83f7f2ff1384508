"""benchmarks/megatron_side_by_side.py's exit status: non-zero when a run that should have run did not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import megatron_side_by_side as side  # noqa: E402


def fake_run(failing: set[str]):
    """Stand-in for one torchrun job: figures for a run that worked, an error for the named ones."""

    def run(name: str, argv: list[str], gpus: int, out: Path) -> dict[str, object]:
        if name in failing:
            return {"argv": argv, "returncode": 1, "error": "AssertionError: Megatron requires CUDA."}
        return {"argv": argv, "returncode": 0, "losses": {5: 1.0}, "step_ms": 10.0, "peak_allocated_GiB": 4.0,
                "offloaded_GiB": 1.0, "exposed_ms": 0.0}  # fmt: skip

    return run


@pytest.mark.parametrize(
    ("failing", "cap", "status"),
    [
        (set(), False, 0),
        ({"ours-no-offload", "ours-auto"}, False, 1),  # every run failed: the case
        ({"ours-auto"}, False, 1),
        ({"capped-no-offload"}, True, 0),  # the capped no-offload run is meant to fail
        ({"capped-step"}, True, 1),
    ],
)
def test_exit_status_says_whether_the_runs_ran(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    failing: set,
    cap: bool,
    status: int,
) -> None:
    monkeypatch.setattr(side, "run", fake_run(failing))
    monkeypatch.setattr(sys, "argv", ["megatron_side_by_side.py", "--out", str(tmp_path), *(["--cap"] if cap else [])])
    assert side.main() == status
    out = capsys.readouterr().out
    assert ("run(s) failed" in out) is bool(status)
    assert (tmp_path / "table.txt").is_file()
