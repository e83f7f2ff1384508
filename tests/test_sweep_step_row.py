"""The memory-speed sweep's ``--step-row``: ours with the whole state off the GPU at the peak, run once uncapped
beside the caps (and upstream's chunked offloader) in the same call, without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import memory_speed_curve as curve
from tests.sweep_helpers import OUR_RUN_S, run_sweep, sweep_run


def step_flags(argv: list[str]) -> bool:
    return "--offload-prefetch" in argv and argv[argv.index("--offload-prefetch") + 1] == "step"


def test_the_estimate_counts_the_step_row_once_as_one_of_ours() -> None:
    for rounds in (1, 3):
        with_step = curve.estimate_s(4, 4, True, rounds, step=True)
        assert with_step - curve.estimate_s(4, 4, True, rounds) == pytest.approx(OUR_RUN_S)


def test_the_step_row_runs_once_uncapped_and_stands_under_each_cap_it_fits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    args = ["--upstream-megatron-lm", str(upstream), "--out", str(tmp_path), "--step-row", "--rounds", "2"]
    code, calls = run_sweep(monkeypatch, [*args, "--caps", "97", "25"], sweep_run(fits=15.0))
    assert code == 0
    steps = [argv for _, argv in calls if step_flags(argv)]
    assert len(steps) == 1 and "--offload-gpu-memory-cap-gib" not in steps[0]  # once, not again in round 2
    assert "--offload-optimizer-states" in steps[0]
    result = json.loads((tmp_path / "curve.json").read_text())
    uncapped = result["step"]
    assert uncapped["outcome"] == "ran" and uncapped["losses_equal"] and uncapped["peak_reserved_GiB"] == 16.2
    assert uncapped["x_no_offload"] == pytest.approx(700 / 600)
    loose, tight = result["caps"][0], result["caps"][1]  # 25% then 97%
    assert loose["cap_GiB"] >= 16.2 and loose["rows"][curve.STEP_ROW]["outcome"] == "ran"
    assert "derived" in loose["rows"][curve.STEP_ROW] and "x_floor" not in loose["rows"][curve.STEP_ROW]
    # the 97% cap lies between the step run's peak allocated (15.6) and reserved (16.2): only a run could tell
    assert 15.6 <= tight["cap_GiB"] < 16.2
    assert tight["rows"][curve.STEP_ROW] == {
        "outcome": "not run",
        "reason": "its uncapped peaks straddle the cap; it runs once, uncapped",
    }
    text = (tmp_path / "curve.txt").read_text()
    assert f"{curve.STEP_ROW}, uncapped: 700.0 ms  x{700 / 600:.3f}  peak reserved 16.20 GiB  losses equal" in text


def test_without_the_flag_no_step_row_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    code, calls = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "50"], sweep_run())
    result = json.loads((tmp_path / "curve.json").read_text())
    assert code == 0 and not any(step_flags(argv) for _, argv in calls)
    assert "step" not in result and curve.STEP_ROW not in result["caps"][0]["rows"]


def test_a_step_row_whose_losses_differ_fails_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        figures = sweep_run()(name, argv, gpus, out, env_extra)
        if step_flags(argv):
            figures["losses"] = {i: loss + 1e-6 for i, loss in figures["losses"].items()}
        return figures

    code, _ = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "50", "--step-row"], run)
    assert code == 1
    assert json.loads((tmp_path / "curve.json").read_text())["step"]["losses_equal"] is False
    assert "losses DIFFER" in (tmp_path / "curve.txt").read_text()
