"""The nightly comparison's memory timeline: the judged rows run without the allocator's history, a short
run of each timeline row with it gives the snapshot, and the plot walks that snapshot's trace back from the
blocks allocated at its end. No GPU: a fake Megatron replays the recorded logs, snapshots are built here, tiny,
in the format of ``torch.cuda.memory._snapshot()``."""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import statistics
import sys
from pathlib import Path

import pytest

from benchmarks import compare_memory, memory_runs
from benchmarks.memory_plots import allocated_timeline
from benchmarks.memory_report import parse_log
from benchmarks.memory_summary import summarize
from tests.compare_memory_helpers import DATA, failing, logs_dir, verdict


def test_a_timeline_command_is_its_rows_with_the_history_for_a_few_iterations(tmp_path: Path) -> None:
    """The capped default's timeline run keeps its cap and every flag of the row; its --train-iters comes
    last (Megatron's argparse keeps the last), over --iters and one in the extra arguments."""
    args = argparse.Namespace(config=Path("configs/nightly_memory.yaml"), out=tmp_path, gpus=1, iters=5, cap_gib=35.08)
    extra = ["--seed", "7", "--train-iters", "9"]
    row = memory_runs.run_command("capped-default", args, extra)
    command = memory_runs.timeline_command("capped-default", args, extra)
    assert command[: len(row)] == row
    added = command[len(row) :]
    assert "--record-memory-history" in added
    path = Path(added[added.index("--memory-snapshot-path") + 1])
    assert path == (tmp_path / "capped-default.snapshot.pickle").resolve()
    iters = [command[i + 1] for i, word in enumerate(command) if word == "--train-iters"]
    assert iters == ["5", "9", str(memory_runs.TIMELINE_ITERS)]
    assert command[command.index("--offload-gpu-memory-cap-gib") + 1] == "35.08"
    megatron = argparse.ArgumentParser(allow_abbrev=False)  # as Megatron's: a repeated flag's last value wins
    megatron.add_argument("--train-iters", type=int)
    assert megatron.parse_known_args(command)[0].train_iters == memory_runs.TIMELINE_ITERS


SLOWER = 1.8  # how much slower the fake Megatron below runs an iteration with the allocator's history

# Megatron replayed: prints a recorded log and exits with the given code; with --record-memory-history it
# copies a snapshot to --memory-snapshot-path and prints the log up to the last --train-iters, each
# iteration SLOWER, then exits with the timeline code.
FAKE_MEGATRON = f"""
import re, shutil, sys
log, code, timeline_code, snapshot, *flags = sys.argv[1:]
text = open(log).read()
if "--record-memory-history" not in flags:
    sys.stdout.write(text)
    sys.exit(int(code))
shutil.copy(snapshot, flags[flags.index("--memory-snapshot-path") + 1])
iters = int([flags[i + 1] for i, flag in enumerate(flags) if flag == "--train-iters"][-1])
for line in text.splitlines():
    if (match := re.search(r"iteration +(\\d+)/ *\\d+ ", line)) and int(match[1]) > iters:
        break
    line = re.sub(r"(iteration +\\d+)/ *\\d+ ", lambda m: f"{{m[1]}}/{{iters:8}} ", line)
    speed = lambda m: f"{{m[1]}}{{float(m[2]) * {SLOWER}:.1f}}"
    print(re.sub(r"(elapsed time per iteration \\(ms\\): )([\\d.]+)", speed, line))
sys.exit(int(timeline_code))
"""


@pytest.mark.parametrize("failing_row, failing_timeline", [(None, "step"), ("capped-default", None)])
def test_timeline_runs_follow_the_rows_that_ran_through(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    failing_row: str | None,
    failing_timeline: str | None,
) -> None:
    """Each of baseline, step and capped-default that ran through gets a short run with the allocator's
    history; its exit status is recorded; a failed one only leaves its line out of the plot, and the plot's
    window is a median step of the timeline run, not of the row."""
    snapshot_file = tmp_path / "recorded.snapshot.pickle"
    snapshot_file.write_bytes(pickle.dumps(snapshot(FINAL, TRACE)))
    failed_rows = {"cpu-offload", "capped-no-offload", failing_row}

    def replay(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
        codes = [str(int(name in failed_rows)), str(int(name == failing_timeline))]
        return [sys.executable, "-c", FAKE_MEGATRON, str(DATA / f"{name}.log"), *codes, str(snapshot_file)]

    windows: dict[str, float | None] = {}

    def timelines(snapshots: dict, seen: dict, notes: list[str]) -> dict:
        windows.clear()  # the report is built before the timeline reruns and again after: the last one counts
        windows.update(seen)
        return plotted(snapshots, seen, notes)

    plotted = compare_memory.timelines
    monkeypatch.setattr(memory_runs, "run_command", replay)
    monkeypatch.setattr(compare_memory, "timelines", timelines)
    out_dir = tmp_path / "out"
    code = compare_memory.main(["--config", "configs/nightly_memory.yaml", "--out", str(out_dir)])
    printed = capsys.readouterr()
    info = json.loads((out_dir / "run_info.json").read_text())
    report = json.loads((out_dir / "report.json").read_text())
    ran = [name for name in memory_runs.TIMELINES if name != failing_row]
    assert list(info["timeline_runs"]) == ran
    assert {name: run["returncode"] for name, run in info["timeline_runs"].items()} == {
        name: int(name == failing_timeline) for name in ran
    }
    for name, run in info["runs"].items():
        assert "--record-memory-history" not in run["command"], name
        assert (out_dir / f"{name}.timeline.log").is_file() == (name in ran)
    for name in ran:
        command = info["timeline_runs"][name]["command"]
        assert command[: len(info["runs"][name]["command"])] == info["runs"][name]["command"]
        assert "--record-memory-history" in command and command[-2:] == ["--train-iters", "4"]
        assert f"[{name}.timeline] iteration 4/4" in printed.err
    assert (code, report["verdict"]) == ((1, "FAIL") if failing_row else (0, "PASS")), printed.out
    note = "memory_timeline.png leaves out {}: its timeline run failed (exit 1)"
    assert [n for n in report["notes"] if "its timeline run failed" in n] == (
        [note.format(failing_timeline)] if failing_timeline else []
    )
    assert not any("allocator-history recording" in n for n in report["notes"])
    assert any(n.startswith("step times come from runs without the allocator's history") for n in report["notes"])
    assert list(windows) == [name for name in memory_runs.TIMELINES if name != failing_timeline]
    if failing_row:  # no timeline run: the plot has no snapshot of it, and says so
        assert f"memory_timeline.png leaves out {failing_row}: no {failing_row}.snapshot.pickle" in report["notes"]
    for name, window in windows.items():
        if name not in ran:
            continue
        row = parse_log((DATA / f"{name}.log").read_text())
        steady = [row.steps[i].step_ms * SLOWER for i in (3, 4)]
        assert window == pytest.approx(statistics.median(steady), abs=0.1)
        assert window != pytest.approx(summarize(row).median_step_ms, rel=0.1)
    # the verdict is the rows': the same folder judged without any timeline run gives the same checks
    rows_only = tmp_path / "rows_only"
    rows_only.mkdir()
    for name in info["runs"]:
        shutil.copy(out_dir / f"{name}.log", rows_only / f"{name}.log")
    (rows_only / "run_info.json").write_text(json.dumps({**info, "timeline_runs": {}}))
    assert compare_memory.main(["--from-logs", str(rows_only)]) == code
    assert json.loads((rows_only / "report.json").read_text())["checks"] == report["checks"]
    assert bool(failing(report)) == bool(failing_row)


def test_the_window_comes_from_the_timeline_log_and_falls_back_to_the_row(tmp_path: Path) -> None:
    """A median step of the timeline run; its last step when it stopped short of a median; the row's
    median in a folder without timeline logs (its snapshots came from the timed rows)."""
    row = summarize(parse_log((DATA / "baseline.log").read_text()))
    summaries = {"baseline": row}
    assert compare_memory.timeline_window(tmp_path, "baseline", summaries) == row.median_step_ms
    line = " iteration {:8}/       4 | elapsed time per iteration (ms): {} | lm loss: 1.0E+01 |"
    times = [2950.0, 1200.0, 1010.0, 1030.0]
    log = tmp_path / "baseline.timeline.log"
    log.write_text("\n".join(line.format(i + 1, ms) for i, ms in enumerate(times)))
    window = compare_memory.timeline_window(tmp_path, "baseline", summaries)
    assert window == statistics.median(times[2:]) and window != row.median_step_ms
    log.write_text("\n".join(line.format(i + 1, ms) for i, ms in enumerate(times[:3])))  # stopped at 3 of 4
    assert compare_memory.timeline_window(tmp_path, "baseline", summaries) == times[2]
    log.write_text("no iterations\n")
    assert compare_memory.timeline_window(tmp_path, "baseline", summaries) == row.median_step_ms


def snapshot(final: list[tuple[int, str]], trace: list[tuple[float, str, int]]) -> dict:
    """A memory snapshot: blocks (size, state) live at the end, and (time ms, action, size) trace events."""
    blocks = [{"size": size, "state": state, "address": 0} for size, state in final]
    events = [{"action": action, "size": size, "time_us": ms * 1000, "addr": 0} for ms, action, size in trace]
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [events]}


TRACE = [
    (0, "alloc", 5000),  # before the window
    (10, "free_requested", 5000),
    (10.5, "free_completed", 5000),
    (12, "segment_alloc", 2**21),
    (12, "alloc", 700),
    (15, "free_requested", 200),  # still read by a side stream at the end: awaiting free, not allocated
    (17, "alloc", 500),
]
FINAL = [(700, "active_allocated"), (500, "active_allocated"), (200, "active_awaiting_free"), (300, "inactive")]


def test_timeline_walks_the_trace_back_from_the_allocated_blocks() -> None:
    xs, ys = allocated_timeline(snapshot(FINAL, TRACE), window_ms=8)
    assert xs == [0, 1, 1.5, 3, 3, 6, 8]
    assert ys == [5200, 200, 200, 200, 900, 700, 1200]
    with pytest.raises(ValueError, match="no allocator trace"):
        allocated_timeline({"segments": [], "device_traces": [[]]}, window_ms=8)


def test_plots_from_logs_and_snapshots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (pip install matplotlib)")
    folder = logs_dir(tmp_path)
    (folder / "baseline.snapshot.pickle").write_bytes(pickle.dumps(snapshot(FINAL, TRACE)))
    code, out, report = verdict(folder, capsys)
    assert code == 0, out
    for name in ("peak_memory.png", "memory_timeline.png"):
        assert (folder / name).read_bytes().startswith(b"\x89PNG")
    assert any("leaves out step: no step.snapshot.pickle" in note for note in report["notes"])
    assert not any("leaves out baseline" in note for note in report["notes"])
    # an older folder: the rows recorded the allocator's history themselves, and their step times show it
    assert "--record-memory-history" in (folder / "baseline.log").read_text().splitlines()[0]
    assert any(note.startswith("step times include the allocator-history recording") for note in report["notes"])
