"""benchmarks/trace_summary.py on synthetic chrome traces whose figures are known: the compute stream's
busy time per profiled iteration, its busy share in the windows where copies run against no offload's in
the same windows, and the overlap verdict (passing and failing cases)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks import profiler_trace
from benchmarks import trace_summary as ts
from tests.chrome_traces import COMPUTE, busy_kernels, kernel, memcpy, step, write

ROOT = Path(__file__).resolve().parents[1]


def base_events(share: float = 0.8) -> list[dict]:
    """No offload: two profiled iterations of 100 ms, the compute stream busy ``share`` throughout."""
    return [step(7, 0, 100), *busy_kernels(0, 100, share), step(8, 200, 100), *busy_kernels(200, 300, share)]


def offload_events(copy_window_share: float = 0.8, rest_share: float = 0.8, length: float = 100) -> list[dict]:
    """With offload, starting at 1000 ms: copies out 25-50 ms and in 50-60 ms into each iteration (the
    copy windows of 25 ms are 25-50 and 50-75), the compute stream busy ``copy_window_share`` there and
    ``rest_share`` elsewhere."""
    events = []
    for number, start in ((7, 1000), (8, 1200)):
        events += [step(number, start, length), memcpy(start + 25, 25, "d2h"), memcpy(start + 50, 10, "h2d")]
        events += busy_kernels(start, start + 25, rest_share) + busy_kernels(start + 25, start + 75, copy_window_share)
        events += busy_kernels(start + 75, start + length, rest_share)
    return events


def summary(tmp_path: Path, base: list[dict], offload: list[dict], **options: float) -> dict:
    """The comparison of the two traces, through files as the harness does it."""
    base_trace = profiler_trace.load_trace(write(tmp_path / "b.json", base))
    return ts.compare(base_trace, profiler_trace.load_trace(write(tmp_path / "o.json", offload)), **options)


def test_copies_that_cost_nothing_pass_with_exact_figures(tmp_path: Path) -> None:
    result = summary(tmp_path, base_events(), offload_events())
    assert result["passed"] and result["verdict"] == "pass"
    assert [it["step"] for it in result["iterations"]] == ["ProfilerStep#7", "ProfilerStep#8"]
    first = result["iterations"][0]
    assert first["busy_ms"] == pytest.approx(80.0) and first["base_busy_ms"] == pytest.approx(80.0)
    assert first["wall_ms"] == pytest.approx(100.0)
    assert first["copy_windows"] == 2 and first["windows_beyond_base"] == 0 and first["share_beyond_base"] is None
    assert [w["offset_ms"] for w in first["windows"]] == [25.0, 50.0]
    assert [w["copy_share"] for w in first["windows"]] == pytest.approx([1.0, 0.4])  # 25 of 25 ms, 10 of 25 ms
    assert first["share"] == pytest.approx(0.8) and first["base_share"] == pytest.approx(0.8)
    assert first["d2h_GiB"] == pytest.approx(64 / 1024) and first["h2d_GiB"] == pytest.approx(64 / 1024)
    assert first["copy_busy_ms"] == pytest.approx(35.0)
    assert result["compute_stream"] == {"base": COMPUTE, "offload": COMPUTE}


def test_a_compute_stream_starved_where_copies_run_fails_the_share_bar(tmp_path: Path) -> None:
    # Busy 0.3 in the copy windows (25-75 ms), made up afterwards: same busy time, the copies held it back.
    offload = offload_events(copy_window_share=0.3, rest_share=0.8, length=125)
    for event in offload:  # 75-125 ms busy 0.9 instead of 0.8: 20 + 15 + 45 = 80 ms, as without offloading
        if event["cat"] == "kernel" and (event["ts"] // 1000) % 200 >= 75:
            event["dur"] *= 0.9 / 0.8
    result = summary(tmp_path, base_events(), offload)
    first = result["iterations"][0]
    assert first["busy_ms"] == pytest.approx(80.0) and first["busy_ok"]
    assert first["share"] == pytest.approx(0.3) and first["base_share"] == pytest.approx(0.8)
    assert first["share_ratio"] == pytest.approx(0.375) and first["share_ok"] is False
    assert not result["passed"] and result["verdict"].startswith("FAIL: busy share in copy windows")


def test_extra_compute_fails_the_busy_bar_and_a_busier_copy_window_is_no_failure(tmp_path: Path) -> None:
    result = summary(tmp_path, base_events(), offload_events(copy_window_share=0.85, rest_share=0.85))
    first = result["iterations"][0]
    assert first["busy_ratio"] == pytest.approx(85 / 80) and not first["busy_ok"]
    assert first["share_ratio"] == pytest.approx(0.85 / 0.8) and first["share_ok"] is True
    assert result["verdict"] == "FAIL: busy time off by more than 3%"


def test_tolerances_are_bars_not_constants(tmp_path: Path) -> None:
    # 0.75 in the copy windows: 77.5 ms busy, 3.1% short (fails 3%); share 0.9375 of no offload's (passes 10%)
    tight = summary(tmp_path, base_events(), offload_events(0.75, 0.8))
    assert tight["iterations"][0]["busy_ratio"] == pytest.approx(77.5 / 80) and tight["iterations"][0]["share_ok"]
    assert tight["verdict"] == "FAIL: busy time off by more than 3%"
    loose = summary(tmp_path, base_events(), offload_events(0.5, 0.8), busy_tolerance=0.5, share_tolerance=0.5)
    assert loose["iterations"][0]["share_ratio"] == pytest.approx(0.5 / 0.8) and loose["passed"]


def test_windows_past_the_no_offload_iteration_are_counted_apart(tmp_path: Path) -> None:
    offload = [step(7, 1000, 150), *busy_kernels(1000, 1150, 80 / 150), memcpy(1110, 30, "d2h")]
    result = summary(tmp_path, [step(7, 0, 100), *busy_kernels(0, 100, 0.8)], offload)
    first = result["iterations"][0]
    assert first["copy_windows"] == 0 and first["windows_beyond_base"] == 2  # 100-125 and 125-150 ms
    assert first["share"] is None and first["share_ok"] is None
    assert first["share_beyond_base"] == pytest.approx(80 / 150)
    assert first["busy_ms"] == pytest.approx(80.0) and result["passed"]
    assert result["verdict"] == (
        "pass (2 copy windows past the no-offload iteration's end, not compared: compute busy 0.53-0.53 there)"
    )


def test_small_copies_copies_on_the_compute_stream_and_side_kernels_do_not_count(tmp_path: Path) -> None:
    offload = offload_events()
    offload += [memcpy(1005, 20, "d2h", mib=0.5), memcpy(1080, 15, "h2d", stream=COMPUTE), kernel(1000, 30, stream=40)]
    offload += [memcpy(1003, 2, "d2h")]  # 2 of 25 ms (8%) in the first window: under the 10% a window needs
    first = summary(tmp_path, base_events(), offload)["iterations"][0]
    assert [w["offset_ms"] for w in first["windows"]] == [25.0, 50.0]
    assert first["busy_ms"] == pytest.approx(80.0)  # the side stream's 30 ms kernel is not compute


def test_iterations_pair_by_profiler_step_number(tmp_path: Path) -> None:
    base = [step(7, 0, 100), *busy_kernels(0, 100, 0.8), step(8, 200, 100), *busy_kernels(200, 300, 0.5)]
    offload = [e for e in offload_events() if not (e["cat"] == "user_annotation" and e["name"].endswith("#7"))]
    iterations = summary(tmp_path, base, offload)["iterations"]
    assert [(it["base_step"], it["step"]) for it in iterations] == [("ProfilerStep#8", "ProfilerStep#8")]
    assert iterations[0]["base_busy_ms"] == pytest.approx(50.0)


def test_busy_time_by_bisection_matches_brute_force() -> None:
    rng = random.Random(20)  # whole-ms spans and windows: the union counted cell by cell is exact
    spans = [(s, s + rng.randint(0, 40)) for s in (rng.randint(0, 1000) for _ in range(300))]
    covered = {cell for a, b in spans for cell in range(a, b)}
    merged = profiler_trace.Intervals.merge([(float(a), float(b)) for a, b in spans])
    for _ in range(300):
        t0 = rng.randint(-50, 1050)
        t1 = t0 + rng.randint(0, 200)
        assert merged.busy(t0, t1) == sum(1 for cell in range(t0, t1) if cell in covered)
    assert merged.busy(10, 10) == 0.0 and profiler_trace.Intervals.merge([]).busy(0, 100) == 0.0


def test_command_line_exit_status_json_and_gzip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write(tmp_path / "base" / "rank-0.json.gz", base_events(), gz=True)
    good = write(tmp_path / "good" / "rank-0.json.gz", offload_events(), gz=True)
    bad = write(tmp_path / "bad.json", offload_events(copy_window_share=0.2))
    assert ts.main([str(base), str(good), "--json", str(tmp_path / "good.json"), "--label", "ours"]) == 0
    assert json.loads((tmp_path / "good.json").read_text())["verdict"] == "pass"
    assert "ours" in capsys.readouterr().out
    assert ts.main([str(base), str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out
    write(tmp_path / "nosteps.json", [kernel(0, 1)])
    assert ts.main([str(base), str(tmp_path / "nosteps.json")]) == 2
    assert "no ProfilerStep" in capsys.readouterr().err


def test_table_names_each_run_and_its_verdict(tmp_path: Path) -> None:
    result = summary(tmp_path, base_events(), offload_events(copy_window_share=0.3))
    text = ts.table({"upstream chunked offload": result, "prefetch step": {"error": "no trace of prefetch step"}})
    assert "upstream chunked offload" in text and "ProfilerStep#8" in text
    assert "verdict: FAIL" in text and "no trace summary: no trace of prefetch step" in text
