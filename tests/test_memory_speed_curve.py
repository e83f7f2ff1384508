"""The memory-speed sweep of benchmarks/megatron_side_by_side.py without a GPU: cap arithmetic, the
floor, the JSON, the plot, rounds, and the iterations a row counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import memory_speed_curve as curve
from tests.sweep_helpers import GIB, OUR_RUN_S, STATE_GIB, run_sweep, sweep_run


def test_caps_are_the_no_offload_peak_reserved_less_a_share_of_the_state() -> None:
    plans = curve.cap_plan(26.41, 10.0, [0, 25, 90])
    assert [p["cap_GiB"] for p in plans] == pytest.approx([26.41, 23.91, 17.41])
    assert [p["saved_GiB"] for p in plans] == pytest.approx([0.0, 2.5, 9.0])


def test_the_floor() -> None:
    # 10.4 GB at 52 GB/s: 200 ms to cross; 50 ms of it hide behind the first forward; a 600 ms iteration
    assert curve.floor_ratio(10.4e9, 52.0, 50.0, 600.0) == pytest.approx(1.25)
    assert curve.floor_ratio(2.0e9, 52.0, 50.0, 600.0) == 1.0  # crosses within the first forward
    assert curve.floor_ratio(0.0, 52.0, 50.0, 600.0) == 1.0


def test_the_estimate_counts_one_no_offload_run_ours_once_per_cap_and_upstream_once() -> None:
    two, five = curve.estimate_s(2, 4, True), curve.estimate_s(5, 4, True)
    assert five - two == pytest.approx(3 * len(curve.OURS) * OUR_RUN_S)
    assert two < 9 * 60 and curve.estimate_s(2, 16, True) < 9 * 60


def test_the_sweep_writes_every_figure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path) -> None:
    args = ["--upstream-megatron-lm", str(upstream), "--out", str(tmp_path), "--global-batch", "8"]
    code, calls = run_sweep(monkeypatch, [*args, "--caps", "90", "50", "0"], sweep_run())
    assert code == 0
    # one uncapped no-offload run, one upstream run, ours (the default: the flag alone) once per cap; no
    # offload never under a cap
    assert len(calls) == 2 + 3 and sum("--offload-optimizer-states" not in a for _, a in calls) == 2
    assert all("--offload-fraction" not in a and "--offload-prefetch" not in a for _, a in calls)
    iters = str(curve.SWEEP_ITERS)
    assert all(a[a.index("--global-batch-size") + 1] == "8" and a[a.index("--train-iters") + 1] == iters
               for _, a in calls)  # fmt: skip
    result = json.loads((tmp_path / "curve.json").read_text())
    assert result["state"]["GiB"] == pytest.approx(STATE_GIB)
    assert result["micro_batches"] == 4 and result["no_offload"]["ms_per_iter"] == 600.0
    assert result["link"] == {"GBps": 52.0, "source": "not measured in this run: --link-gbps 52 (the default)"}
    assert [c["percent"] for c in result["caps"]] == [0, 50, 90]
    tight = result["caps"][2]
    assert tight["cap_GiB"] == pytest.approx(26.4 - 0.9 * STATE_GIB)
    forward = 600.0 / 4 / 3
    assert tight["floor_x"] == pytest.approx(1 + (0.9 * STATE_GIB * GIB / 52e9 * 1e3 - forward) / 600.0)
    ours = tight["rows"]["default"]
    assert ours["outcome"] == "ran" and ours["x_no_offload"] == pytest.approx(700 / 600) and ours["losses_equal"]
    assert ours["x_floor"] == pytest.approx(700 / 600 / tight["floor_x"])  # the distance the acceptance judges
    assert ours["peak_reserved_GiB"] == 16.2
    assert tight["rows"]["no offload"]["outcome"] == "did not fit" and "derived" in tight["rows"]["no offload"]
    assert result["caps"][0]["rows"]["no offload"]["x_no_offload"] == 1.0  # cap 0%: its own uncapped run
    assert tight["rows"]["upstream chunked offload"]["x_no_offload"] == pytest.approx(800 / 600)
    assert "x_floor" not in result["caps"][0]["rows"]["no offload"]  # its uncapped run: ran under no floor
    text = (tmp_path / "curve.txt").read_text()
    assert "cap 90%" in text and f"({700 / 600 / tight['floor_x']:.3f}x its floor)" in text


def test_without_a_logged_link_the_floor_takes_the_one_our_copies_out_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    times: dict[str, float] = {}

    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        flag = "--offload-gpu-memory-cap-gib"
        if flag in argv:  # three capped runs of ours: 5 GiB out in 100, 125 and 80 ms
            times.setdefault(argv[argv.index(flag) + 1], [100.0, 125.0, 80.0][len(times)])
        return sweep_run(copy_out_ms=times)(name, argv, gpus, out, env_extra)

    code, _ = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "90", "75", "50"], run)
    result = json.loads((tmp_path / "curve.json").read_text())
    assert code == 0 and result["link"]["GBps"] == pytest.approx(5 * GIB / 0.1 / 1e9)  # the median run's
    assert result["link"]["source"].startswith("our copies out in this sweep (median of 3 runs")
    tight = result["caps"][2]
    forward = 600.0 / 4 / 3
    assert tight["floor_x"] == pytest.approx(1 + (0.9 * STATE_GIB * GIB / (5 * GIB / 0.1) * 1e3 - forward) / 600.0)


def test_rounds_run_every_row_again_in_turn_and_pool_its_iterations(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        figures = sweep_run()(name, argv, gpus, out, env_extra)
        if name.endswith("-round2"):  # the machine ran 60 ms slower in the second round, every row alike
            times = figures["step_ms_by_iteration"]
            figures["step_ms_by_iteration"] = {i: ms + 60.0 for i, ms in times.items()}
        return figures

    code, calls = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "90", "50", "--rounds", "2"], run)
    assert code == 0  # the second round in reverse
    assert [name.removeprefix("sweep-gbcfg-") for name, _ in calls] == [
        "no-offload", "cap90-default", "cap50-default", "cap50-default-round2", "cap90-default-round2",
        "no-offload-round2"]  # fmt: skip
    result = json.loads((tmp_path / "curve.json").read_text())
    assert result["rounds"] == 2
    assert result["no_offload"]["ms_per_iter"] == 630.0 and result["no_offload"]["ms_per_round"] == [600.0, 660.0]
    ours = result["caps"][1]["rows"]["default"]
    assert ours["ms_per_iter"] == 730.0 and ours["ms_per_round"] == [700.0, 760.0]
    assert ours["x_no_offload"] == pytest.approx(730 / 630) and ours["losses_equal"]
    forward = 630.0 / 4 / 3  # the floor counts on the pooled no-offload iteration
    floor = 1 + (0.9 * STATE_GIB * GIB / 52e9 * 1e3 - forward) / 630.0
    assert result["caps"][1]["floor_x"] == pytest.approx(floor)
    assert "(rounds 700, 760)" in (tmp_path / "curve.txt").read_text()


def test_a_third_round_runs_in_the_first_order_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    code, calls = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "90", "50", "--rounds", "3"], sweep_run())
    assert code == 0
    assert [name.removeprefix("sweep-gbcfg-") for name, _ in calls][6:] == [
        "no-offload-round3", "cap90-default-round3", "cap50-default-round3"]  # fmt: skip
    assert json.loads((tmp_path / "curve.json").read_text())["no_offload"]["ms_per_round"] == [600.0] * 3


def test_rounds_must_be_one_or_more(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        run_sweep(monkeypatch, ["--out", str(tmp_path), "--rounds", "0"], sweep_run())


def test_the_sweep_plots_its_curve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the test and nightly extras install it)")
    code, _ = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "90", "50"], sweep_run())
    assert code == 0 and json.loads((tmp_path / "curve.json").read_text())["plot"] == "curve.png"
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_a_capped_no_offload_run_that_fails_is_did_not_fit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    code, calls = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "50", "--run-every-cell"], sweep_run())
    assert code == 0 and [name for name, _ in calls][-1] == "sweep-gbcfg-cap50-no-offload"
    row = json.loads((tmp_path / "curve.json").read_text())["caps"][0]["rows"]["no offload"]
    assert row == {"outcome": "did not fit", "reason": "torch.OutOfMemoryError: CUDA out of memory."}


def test_ours_not_fitting_fails_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    code, _ = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "90"], sweep_run(fits=20.0))
    assert code == 1
    assert json.loads((tmp_path / "curve.json").read_text())["caps"][0]["rows"]["default"]["outcome"] == ("did not fit")


def test_without_matplotlib_the_json_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _ = run_sweep(monkeypatch, ["--out", str(tmp_path), "--caps", "50"], sweep_run())
    result = json.loads((tmp_path / "curve.json").read_text())
    assert code == 0 and result["plot"].startswith("no plot: matplotlib is not installed")
    assert not (tmp_path / "curve.png").exists()


def test_the_sweep_counts_the_iterations_past_warm_up_at_each_log_interval() -> None:
    assert curve.iterations_for(1) == (24, (3, 24))
    assert curve.iterations_for(5) == (40, (10, 40))  # lines 10, 15, ... 40: iterations 6-40
    logged = {"step_ms_by_iteration": {"5": 900.0, "10": 510.0, "15": 530.0, "20": 520.0}}
    assert curve.median_ms(logged, curve.iterations_for(5)[1]) == 520.0  # the warm-up line left out
    retried = logged | {"allocator_retries_by_iteration": {"5": 40, "10": 1, "15": 2, "20": 0}}
    assert curve.cell(retried, None, (10, 20))["allocator_retries"] == 3


def test_a_row_says_how_far_its_iterations_spread_and_what_came_back_through_the_step() -> None:
    times = {str(i): 500.0 + 10 * (i % 4) for i in range(1, 13)}  # 500, 510, 520, 530 over and over
    streamed = {str(i): 2.0 if i > 2 else 9.0 for i in range(1, 13)}
    row = curve.cell({"step_ms_by_iteration": times, "streamed_GiB_by_iteration": streamed}, None)
    low, high = row["ms_quartiles"]
    assert 500.0 <= low < row["ms_per_iter"] < high <= 530.0
    assert row["streamed_in_step_GiB"] == 2.0  # the first iterations, which stream everything, left out
