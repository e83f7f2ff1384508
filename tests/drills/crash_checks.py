"""What a crash entry checks of each side (offloaded and control) before their values are compared:
the kill happened where asked, the tracker names the last complete save before it, a save cut short by
the kill is left incomplete and not loaded, the resumed run loaded the right iteration and logged every
one after it. Also the watch that stops a killed run as soon as it cannot end well.
"""

from __future__ import annotations

from pathlib import Path

from tests.drills.drill_checkpoints import is_complete, losses_and_grad_norms
from tests.drills.drill_runs import CRASH_MARKER, LOADED, Watch, last_iteration, tail

NEVER_REACHED = "never reached the"  # crash_driver.py's line when training ended before the kill point
TRAIN_ITERS, SAVE_INTERVAL = 20, 5


def killed_run_watch(mode: str, kill_at: int, after_kill_s: float) -> Watch:
    """Stop the killed run as soon as it cannot end well: it logged an iteration past its kill point
    (the kill will never come), or its SIGKILL line is ``after_kill_s`` old and it has not ended
    (torchrun waiting for a dead child, or a process that survived the kill)."""
    seen: list[float] = []

    def watch(text: str, elapsed: float) -> str | None:
        if CRASH_MARKER in text:
            seen[:] = seen or [elapsed]
            if elapsed - seen[0] > after_kill_s:
                return f"its SIGKILL came {seen[0]:.0f} s in, and it had not ended {after_kill_s:g} s later"
            return None
        iteration = last_iteration(text)
        if iteration is not None and iteration > kill_at:
            return (
                f"it never reached its kill point ({mode} of iteration {kill_at}): iteration {iteration} "
                "logged with no SIGKILL"
            )
        return None

    return watch


def check(
    mode: str,
    kill_at: int,
    results: dict,
    logs: dict[str, str],
    facts: dict,
    save_dir: Path | None = None,
    offloaded: bool = True,
) -> list[str]:
    """Failures of one side of a crash entry before its values are compared, as sentences: its runs, the
    kill, the tracker, the save cut short, the load, the iterations logged after it."""
    failures = []
    for name in ("uninterrupted", "resumed"):
        result = results[name]
        if result.get("stopped"):
            failures.append(result.get("verdict") or f"{name} run stopped by the drill: {result['stopped']}")
        elif result["returncode"]:
            failures.append(f"{name} exited {result['returncode']}: {tail(logs[name], 2)}")
    killed = results["killed"]
    marker = next((line for line in logs["killed"].splitlines() if CRASH_MARKER in line), None)
    facts["kill"] = marker
    expected = (kill_at - 1) // SAVE_INTERVAL * SAVE_INTERVAL  # the last save before the kill
    if killed.get("stopped"):
        failures.append(killed.get("verdict") or f"killed run stopped by the drill: {killed['stopped']}")
    elif marker is None:
        where = last_iteration(logs["killed"])
        ran = f"ended after iteration {where}" if where is not None else "ended before its first iteration"
        ran = "ran to its end" if NEVER_REACHED in logs["killed"] else ran
        failures.append(
            f"killed run never reached its kill point ({mode} of iteration {kill_at}): it {ran}, "
            f"exit {killed['returncode']}; last log lines: {tail(logs['killed'], 3)}"
        )
    elif killed["returncode"] == 0:
        failures.append(f"killed run: its SIGKILL line was printed but it exited 0 ({marker})")
    if marker is not None and mode == "after-step" and offloaded:
        pending = marker.partition("pending copy-out bytes ")[2].split(" ")[0]
        if not pending.isdigit() or int(pending) <= 0:
            failures.append("killed: no copy to host was in flight at the kill")
    if facts["tracker_after_kill"] != expected:
        failures.append(
            f"after the kill the tracker names iteration {facts['tracker_after_kill']}, expected {expected}"
        )
    elif save_dir is not None:
        facts["tracker_names_complete_save"] = is_complete(save_dir / f"iter_{expected:07d}")
        if not facts["tracker_names_complete_save"]:
            failures.append(f"the tracker names iteration {expected}, whose save has no .metadata (incomplete)")
    wanted_cut = [f"iter_{kill_at:07d}"] if mode == "checkpoint" else []
    if facts["cut_short_after_kill"] != wanted_cut:
        failures.append(f"saves left incomplete by the kill: {facts['cut_short_after_kill']}, expected {wanted_cut}")
    loaded = [int(i) for i in LOADED.findall(logs["resumed"])]
    facts["resumed_loaded"] = loaded
    if loaded != [expected]:
        failures.append(
            f"resumed: no 'successfully loaded checkpoint ... at iteration {expected}' in the log ({loaded})"
        )
    logged = sorted(losses_and_grad_norms(logs["resumed"]))
    wanted = list(range(expected + 1, TRAIN_ITERS + 1))
    if logged != wanted:
        failures.append(f"resumed: logged iterations {logged}, expected {wanted}")
    return failures
