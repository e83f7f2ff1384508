"""Whole crash entries of the crash drill, on the CPU with real subprocesses (no GPU, no Megatron), run
with a stand-in for tests/gpu/crash_driver.py that prints Megatron's lines and writes torch_dist-like
saves: a good entry, a difference of megatron-core's resume and one of ours, and killed, resumed and
uninterrupted runs that miss or pass their kill point, outlive their SIGKILL or hang. Each ends with a
verdict within its bound; nothing of the bound logic is mocked. The bounds of single runs are
test_drill_bounds.py's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.drills import crash_entries, drill_runs

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the drill reads processes from /proc")


FAKE_DRIVER = r'''
"""Stands in for tests/gpu/crash_driver.py: Megatron's iteration, load and kill lines, and saves."""
import os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
save = Path(args[args.index("--save") + 1])
loading = "--load" in args
mode = os.environ.get("OFFLOAD_CRASH_AT")
kill_at = int(os.environ.get("OFFLOAD_CRASH_ITERATION", "0"))
fake = os.environ.get("FAKE", "")
offloaded = "--offload-optimizer-states" in args  # the control runs without it
run = "resumed" if loading else ("killed" if mode else "uninterrupted")
# A difference of megatron-core's own resume shows in both resumed runs; one of ours only with offloading.
differs = loading and (fake == "megatron-difference" or (fake == "ours-differs" and offloaded))


def hang():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1e6)


def line(i):
    print(
        f" [2026-11-24 00:00:00] iteration {i:8d}/      20 | consumed samples: {8 * i:12d} | "
        f"lm loss: {10 + i / 100 + (0.5 if differs and i == 12 else 0):.6E} | "
        f"loss scale: 1.0 | grad norm: {i}.25 | number of skipped iterations:   0 |",
        flush=True,
    )


def save_at(i, complete=True):
    directory = save / f"iter_{i:07d}"
    if not complete:
        directory.mkdir(parents=True)
        (directory / "__0_0.distcp").write_bytes(b"half a file")
        return
    if fake not in ("", "megatron-difference", "ours-differs"):  # the hang cases need no real checkpoint
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".metadata").write_bytes(b"")
    else:
        import torch
        import torch.distributed.checkpoint as dcp

        state = {"model": {"w": torch.arange(6.0) * i}, "optimizer": {"exp_avg": torch.full((3,), i / 7)}}
        state["rng"] = torch.tensor([int(differs and fake == "megatron-difference")], dtype=torch.uint8)
        if differs and fake == "ours-differs":
            state["optimizer"]["exp_avg"][1] = 1.0
        dcp.save(state, checkpoint_id=str(directory))
    (save / "latest_checkpointed_iteration.txt").write_text(str(i))


def kill(where):
    where = where if offloaded else where.split(",")[0] + " (no offloader attached)"
    print(f"megatron-offload crash drill: SIGKILL {where} (mode {mode}, iteration {kill_at})", flush=True)
    if fake == "killed-does-not-die":
        hang()
    os.kill(os.getpid(), signal.SIGKILL)


if run == "uninterrupted" and fake == "uninterrupted-hangs":
    hang()
start = 1
if loading:
    tracker = save / "latest_checkpointed_iteration.txt"
    start = (int(tracker.read_text()) if tracker.exists() else 0) + 1
    print(f"  successfully loaded checkpoint from {save} [ t 1/1, p 1/1 ] at iteration {start - 1}", flush=True)
    if fake == "resumed-hangs":
        hang()
armed = run == "killed" and fake not in ("no-kill", "killed-passes")
for i in range(start, 21):
    if armed and mode != "checkpoint" and i == kill_at:
        kill(f"after the step of iteration {i}, pending copy-out bytes 4096")
    line(i)
    if run == "killed" and fake == "killed-passes" and i == kill_at + 1:
        hang()
    if i % 5 == 0:
        if armed and mode == "checkpoint" and i == kill_at:
            save_at(i, complete=False)
            kill(f"while saving the checkpoint of iteration {i}, after writing one file")
        save_at(i)
if run == "killed":
    print(f"megatron-offload crash drill: iteration {kill_at} never reached the {mode} kill", flush=True)
    sys.exit(3)
'''


def entry(tmp_path: Path, mode: str, fake: str, bounds: drill_runs.Bounds) -> tuple[list[str], dict, float]:
    """One crash entry with the stand-in driver: its failures, facts and seconds."""
    verdict, facts, seconds = judged(tmp_path, mode, fake, bounds)
    return verdict.failures, facts, seconds


def judged(tmp_path: Path, mode: str, fake: str, bounds: drill_runs.Bounds) -> tuple:
    """One crash entry with the stand-in driver: its verdict, facts and seconds."""
    driver = tmp_path / "fake_driver.py"
    driver.write_text(FAKE_DRIVER)
    drill = crash_entries.CrashDrill(tmp_path / "out", [sys.executable], bounds, driver=str(driver), args=[])
    start = time.monotonic()
    try:
        _, verdict, facts = drill.run_entry(crash_entries.CrashEntry(f"crash-{mode}", mode), {"FAKE": fake})
    finally:
        drill.close()
    return verdict, facts, time.monotonic() - start


QUICK = drill_runs.Bounds(run_s=4, after_kill_s=1, linger_s=0.5)


def test_a_good_entry_passes_with_every_check_real(tmp_path: Path) -> None:
    verdict, facts, _ = judged(tmp_path, "checkpoint", "", drill_runs.Bounds(run_s=120, linger_s=0.5))
    assert verdict.status == "pass" and verdict.failures == [], verdict.failures
    for side in ("offloaded", "control-"):
        assert facts[side]["tracker_after_kill"] == 10 and facts[side]["tracker_names_complete_save"]
        assert facts[side]["cut_short_after_kill"] == ["iter_0000015"] and facts[side]["resumed_loaded"] == [10]
        assert facts[side]["left_behind_by_kill"] == []
    assert facts["differences"] == {"offloaded": {}, "control": {}}
    assert "no offloader attached" in facts["control-"]["kill"] and "no offloader" not in facts["offloaded"]["kill"]
    for run in ("uninterrupted", "killed", "resumed"):
        assert (tmp_path / "out" / f"crash-checkpoint-{run}.log").exists()
        assert (tmp_path / "out" / f"crash-checkpoint-control-{run}.log").exists()


def test_a_difference_of_megatron_cores_resume_is_named_so_through_the_control(tmp_path: Path) -> None:
    verdict, facts, _ = judged(tmp_path, "after-step", "megatron-difference", drill_runs.Bounds(run_s=120))
    assert verdict.status == "megatron-core's difference" and verdict.failures == []
    assert [d.split(":")[0] for d in verdict.megatron_core] == ["iteration 12 lm loss", "final checkpoint rng"]
    assert facts["differences"]["offloaded"] == facts["differences"]["control"]


def test_a_difference_only_with_offloading_fails(tmp_path: Path) -> None:
    verdict, facts, _ = judged(tmp_path, "backward", "ours-differs", drill_runs.Bounds(run_s=120))
    assert verdict.status == "FAIL" and verdict.megatron_core == []
    assert [f.split(":")[0] for f in verdict.failures] == ["iteration 12 lm loss", "final checkpoint optimizer/exp_avg"]
    assert all(f.endswith("the run without offloading resumed equal") for f in verdict.failures)
    assert facts["differences"]["control"] == {}


def test_a_killed_run_that_never_reaches_its_kill_point_is_reported_as_such(tmp_path: Path) -> None:
    failures, _, seconds = entry(tmp_path, "after-step", "no-kill", QUICK)
    # Ended by itself ("it ran to its end, exit 3"), or stopped by the drill once iteration 14 was logged.
    assert any("never reached its kill point (after-step of iteration 13)" in f for f in failures), failures
    assert seconds < 3 * QUICK.run_s


def test_a_killed_run_that_passes_its_kill_point_is_stopped_there_not_at_its_bound(tmp_path: Path) -> None:
    bounds = drill_runs.Bounds(run_s=60, after_kill_s=1, linger_s=0.5)
    failures, _, seconds = entry(tmp_path, "backward", "killed-passes", bounds)
    expected = (
        "killed run stopped by the drill: it never reached its kill point (backward of iteration 13): "
        "iteration 14 logged with no SIGKILL (after iteration 14)"
    )
    assert any(f.startswith(expected) for f in failures), failures
    assert seconds < 30  # the killed run was stopped at once, far from its 60 s bound


def test_a_killed_run_that_does_not_die_ends_with_a_verdict_after_its_kill_bound(tmp_path: Path) -> None:
    failures, _, seconds = entry(tmp_path, "after-step", "killed-does-not-die", QUICK)
    assert any(
        f.startswith("killed run stopped by the drill: its SIGKILL came ")
        and "and it had not ended 1 s later (after iteration 12, after its SIGKILL line)" in f
        for f in failures
    ), failures
    assert seconds < 3 * QUICK.run_s


def test_a_resumed_run_that_hangs_ends_the_entry_with_a_verdict_naming_it(tmp_path: Path) -> None:
    failures, _, seconds = entry(tmp_path, "after-step", "resumed-hangs", QUICK)
    expected = (
        "resumed run stopped by the drill: no exit within 4 s "
        "(after loading the checkpoint of iteration 10, before its first iteration); last log lines:"
    )
    assert any(f.startswith(expected) for f in failures), failures
    assert QUICK.run_s <= seconds < 3 * QUICK.run_s


def test_an_uninterrupted_run_that_hangs_is_named_and_not_run_again(tmp_path: Path) -> None:
    driver = tmp_path / "fake_driver.py"
    driver.write_text(FAKE_DRIVER)
    drill = crash_entries.CrashDrill(tmp_path / "out", [sys.executable], QUICK, driver=str(driver), args=[])
    entries = [crash_entries.CrashEntry(f"crash-{mode}", mode) for mode in ("after-step", "backward")]
    try:
        start = time.monotonic()
        first = drill.run_entry(entries[0], {"FAKE": "uninterrupted-hangs"})[1].failures
        second = drill.run_entry(entries[1], {"FAKE": "uninterrupted-hangs"})[1].failures
        seconds = time.monotonic() - start
    finally:
        drill.close()
    expected = "uninterrupted run stopped by the drill: no exit within 4 s (before its first iteration)"
    control = "without offloading: control-uninterrupted run stopped by the drill: no exit within 4 s"
    for failures in (first, second):
        assert failures[0].startswith(expected) and any(f.startswith(control) for f in failures), failures
    assert seconds < QUICK.run_s + 4 * 3  # the hangs were waited for once, at once, their verdicts given twice
