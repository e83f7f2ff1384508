"""The host's pace beside benchmark runs (benchmarks/host_pace.py): the sampler as a real child process, a
run's share of its samples, Megatron's stamped log lines, and the sweep printing each row's pace."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from benchmarks import host_pace
from benchmarks import megatron_job as job
from benchmarks import megatron_side_by_side as side
from benchmarks import memory_speed_curve as curve


def lines_in(path: Path, count: int, within_s: float = 15.0) -> list[tuple[float, float]]:
    """The sampler's lines once it has written ``count`` (it samples once a second); fails past ``within_s``."""
    deadline = time.monotonic() + within_s
    while len(samples := host_pace.read_samples(path)) < count:
        assert time.monotonic() < deadline, f"the sampler wrote {len(samples)} lines in {within_s} s"
        time.sleep(0.1)
    return samples


def test_the_loop_takes_time_and_the_same_loop_about_the_same() -> None:
    first, second = host_pace.spin_ms(), host_pace.spin_ms()
    assert 0 < first < 1000 and 0 < second < 1000


def test_a_span_gets_its_median_and_the_share_slower_than_the_calls_fast_level() -> None:
    samples = [(float(t), 1.0) for t in range(20)] + [(20.0, 1.8), (21.0, 1.2), (22.0, 1.9), (23.0, 1.0)]
    pace = host_pace.pace_over(samples, 20.0, 23.0)
    assert pace is not None and pace["fast_ms"] == 1.0 and pace["samples"] == 4
    assert pace["median_ms"] == pytest.approx(1.5) and pace["slow_share"] == 0.5  # 1.2 is under 1.3x the fast level
    assert host_pace.pace_over(samples, 30.0, 40.0) is None  # nothing sampled then


def test_a_line_cut_short_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "pace.txt"
    path.write_text("1.0 0.9\n2.0 1.7\n3.0")
    assert host_pace.read_samples(path) == [(1.0, 0.9), (2.0, 1.7)]
    assert host_pace.read_samples(tmp_path / "none.txt") == []


def test_megatrons_stamps_give_the_counted_iterations_span() -> None:
    text = "\n".join(f" [2026-11-29 10:42:{50 + i}.500000] iteration        {i}/       5 | elapsed time per iteration "
                     f"(ms): 700.0 | lm loss: 4.1" for i in range(1, 6))  # fmt: skip
    stamps = host_pace.iteration_times(text)
    assert sorted(stamps) == [1, 2, 3, 4, 5] and stamps[5] - stamps[1] == pytest.approx(4.0)
    start, end = host_pace.counted_span(stamps, [3, 4, 5])
    assert (start, end) == (stamps[2], stamps[5])  # iteration 3 ran after line 2 was written
    assert host_pace.counted_span(stamps, [3, 9]) is None and host_pace.counted_span({}, []) is None
    assert host_pace.logged_span(text, lambda logged: [i for i in logged if i > 2]) == (stamps[2], stamps[5])
    assert host_pace.logged_span("no iteration lines", lambda logged: logged) is None


def test_the_sampler_runs_beside_a_run_and_stops_with_the_block(tmp_path: Path) -> None:
    path = tmp_path / "pace.txt"
    with host_pace.PaceLog(path) as pace:
        samples = lines_in(path, 2)
        span = (samples[0][0] - 0.5, samples[-1][0] + 0.5)
        figures = pace.timed(lambda name: {"name": name, "counted_span": span})("row")
        untimed = pace.timed(lambda name: {"name": name})("failed")
    assert pace.process is None
    assert figures["name"] == "row" and figures["host_pace"]["samples"] >= 2 and figures["host_pace"]["median_ms"] > 0
    assert "host_pace" not in untimed  # a run that logged no iterations has no span
    written = len(host_pace.read_samples(path))
    time.sleep(1.5)
    assert len(host_pace.read_samples(path)) == written  # stopped with the block


def test_a_row_prints_each_runs_pace() -> None:
    runs = [
        {"host_pace": {"median_ms": 0.95, "slow_share": 0.1}},
        {},
        {"host_pace": {"median_ms": 1.62, "slow_share": 0.75}},
    ]
    row = host_pace.pooled_pace(runs)
    assert row == {"host_pace_ms": [0.95, 1.62], "host_slow_share": [0.1, 0.75]}
    assert host_pace.pace_text(row) == "  host 0.95 ms, 10% slow / 1.62 ms, 75% slow"
    assert host_pace.pace_text({}) == "" and host_pace.pooled_pace([{}]) == {}


def test_the_sweep_prints_the_hosts_pace_beside_each_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        samples = lines_in(out / "host-pace.txt", 1)  # the sweep's sampler, started before the first run
        offload = "--offload-optimizer-states" in argv
        return {"argv": argv, "returncode": 0, "losses": {i: 10.0 - i for i in range(1, 25)},
                "step_ms_by_iteration": dict.fromkeys(range(1, 25), 700.0 if offload else 600.0),
                "peak_allocated_GiB": 15.6 if offload else 26.2, "peak_reserved_GiB": 16.2 if offload else 26.4,
                "parameters": 955_000_000, "counted_span": (samples[0][0] - 1, samples[-1][0] + 1),
                "megatron_args": {"micro_batch_size": "2", "global_batch_size": "8"}}  # fmt: skip

    monkeypatch.setattr(job, "run", run)
    monkeypatch.setattr(side, "preflight", lambda argv: None)
    argv = ["--sweep", "--out", str(tmp_path), "--global-batch", "8", "--caps", "90"]
    monkeypatch.setattr(sys, "argv", ["megatron_side_by_side.py", *argv])
    assert side.main() == 0
    result = json.loads((tmp_path / "curve.json").read_text())
    ours = result["caps"][0]["rows"]["default"]
    assert len(ours["host_pace_ms"]) == 1 and len(result["no_offload"]["host_pace_ms"]) == 1
    text = (tmp_path / "curve.txt").read_text()
    assert text.count(" ms, ") >= 2 and "% slow" in text.splitlines()[0]  # no offload's pace in the header
    assert curve.pooled_cell([{"step_ms_by_iteration": {3: 1.0}}], None).get("host_pace_ms") is None


def test_the_matrix_gives_every_run_its_pace_and_a_pooled_row_each_rounds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.side_by_side_helpers import fake_run, run_main

    worked = fake_run(set())

    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        samples = lines_in(out / "host-pace.txt", 1)  # the matrix's sampler, started before the first run
        span = (samples[0][0] - 1, samples[-1][0] + 1)
        return worked(name, argv, gpus, out, env_extra) | {"counted_span": span}

    monkeypatch.setattr(side, "preflight", lambda argv: None)
    argv = ["--out", str(tmp_path), "--log-intervals", "1", "--rounds", "2", "--only", "no offload", "prefetch step"]
    code, calls = run_main(monkeypatch, argv, run)
    assert code == 0 and len(calls) == 4
    rows = json.loads((tmp_path / "side_by_side.json").read_text())["runs"]["log-interval 1"]
    assert len(rows["prefetch step"]["host_pace_ms"]) == 2 and len(rows["no offload"]["host_slow_share"]) == 2
    lines = [
        line
        for line in (tmp_path / "table.txt").read_text().splitlines()
        if line.startswith(("no offload", "prefetch"))
    ]
    assert len(lines) == 2 and all(line.count("% slow") == 2 for line in lines)
