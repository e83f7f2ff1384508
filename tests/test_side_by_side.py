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
    ("failing", "status"),
    [
        (set(), 1),  # the capped no-offload runs ran although the cap should have stopped them
        ({"log1-cap-90-no-offload", "log1-cap-50-no-offload"}, 0),  # as meant: only those fail
        ({"log1-no-offload", "log1-full-offload-auto"}, 1),  # every run failed: issue 16's case
        ({"log1-cap-90-no-offload", "log1-cap-50-no-offload", "log1-cap-90-step"}, 1),
    ],
)
def test_exit_status_says_whether_every_run_did_what_it_must(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, failing: set, status: int
) -> None:
    names = []
    monkeypatch.setattr(side, "run", lambda name, *rest: names.append(name) or fake_run(failing)(name, *rest))
    monkeypatch.setattr(sys, "argv", ["megatron_side_by_side.py", "--out", str(tmp_path), "--log-intervals", "1"])
    assert side.main() == status
    out = capsys.readouterr().out
    assert ("did not do what they must" in out) is bool(status)
    assert (tmp_path / "table.txt").is_file()
    if "log1-no-offload" not in failing:
        assert len(names) == len(side.MATRIX)  # the whole matrix ran (capped runs took their cap from it)
