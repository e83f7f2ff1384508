"""The crash entries of tests/drills/integration.py: a run with offloading killed with SIGKILL at a chosen
moment (tests/gpu/crash_driver.py), then a new process that loads the last complete checkpoint and runs
on; compared bitwise with an uninterrupted run of the same flags, beside a control: the same kill at the
same point in a run without offloading, resumed the same way (crash_verdict.py says how the two are read).

Per entry (``crash-after-step``, ``crash-backward``, ``crash-checkpoint``), on each side (offloaded and
control), checks: the kill happened where asked (after-step with offloading: with copies to host still
pending); ``latest_checkpointed_iteration.txt`` names the last save before the kill, and that save is
complete (its ``.metadata`` written); a save cut short by the kill (crash-checkpoint) is left without its
``.metadata`` and is not what the resumed run loads; the resumed run says it loaded the last complete
iteration and logs every iteration after it. Then the differences: every loss and grad norm as printed,
and every tensor of both final checkpoints (parameters, Adam state, RNG states), bitwise.

The two uninterrupted runs are made once per invocation, beside the first entry's killed runs; an
entry's offloaded and control runs run at once (a tiny.yaml run spends most of its minute starting up
and needs well under 2 GiB of the GPU), so an entry takes about two runs' time. Every run is bounded
(drill_runs.run_bounded): a run that hangs ends its entry with a verdict naming it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tests.drills.crash_checks import SAVE_INTERVAL, TRAIN_ITERS, check, killed_run_watch
from tests.drills.crash_verdict import Differences, Verdict, checkpoint_differences, judge, logged_differences
from tests.drills.drill_checkpoints import cut_short, fingerprints, is_complete, last_complete_iteration
from tests.drills.drill_runs import Bounds, Watch, kill_live_runs, run_bounded, verdict

CRASH_DRIVER = "tests/gpu/crash_driver.py"
KILL_AT = {"after-step": 13, "backward": 13, "checkpoint": 15}  # the iteration of each kill
ENTRY_BUDGET_S = 180.0  # each entry, its control included, in under 3 minutes on one H100
ARGS = [  # every run of every entry, offloaded or not
    *("--config", "configs/tiny.yaml", "--train-iters", str(TRAIN_ITERS), "--log-memory-interval", str(TRAIN_ITERS)),
    *("--ckpt-format", "torch_dist", "--save-interval", str(SAVE_INTERVAL)),
]
OFFLOAD_STATES = ("--offload-optimizer-states", "--offload-fraction", "1")  # all of it moves: copies to kill
CONTROL = "control-"  # the control's run names: control-uninterrupted, control-killed, control-resumed


@dataclass(frozen=True)
class CrashEntry:
    """One crash entry: where the kill comes, and the flags of its offloaded runs (its control runs the
    same arguments without them)."""

    name: str
    mode: str  # a kill point of tests/gpu/crash_driver.py: after-step, backward or checkpoint
    flags: tuple[str, ...] = OFFLOAD_STATES


ENTRIES = (
    CrashEntry("crash-after-step", "after-step"),
    CrashEntry("crash-backward", "backward"),
    CrashEntry("crash-checkpoint", "checkpoint"),
    # Weight streaming, once --offload-weights exists: the same kills with both offloads on, e.g.
    #   CrashEntry("crash-after-step-weights", "after-step", (*OFFLOAD_STATES, "--offload-weights")),
    # The control stays the run without any offloading. A kill point of weight streaming's own (inside a
    # weight prefetch) is a new mode in crash_driver.py, with a Megatron-level twin for its control there.
)


def together(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run the calls at once, one thread each; their results by name. Interrupted, every run is killed."""
    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda n=n, c=c: results.update({n: c()}), daemon=True) for n, c in calls.items()
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:
        kill_live_runs()
        raise
    return results


class CrashDrill:
    """The crash entries of one invocation: they share the uninterrupted runs (made once per set of
    flags) and a scratch directory for checkpoints. ``launcher`` starts a run (torchrun on a GPU machine;
    the CPU tests give a plain interpreter and a stand-in ``driver``); ``parse`` adds what integration.py
    reads from a log."""

    def __init__(
        self,
        out: Path,
        launcher: list[str],
        bounds: Bounds | None = None,
        *,
        driver: str = CRASH_DRIVER,
        args: list[str] | None = None,
        cwd: Path | None = None,
        parse: Callable[[str], dict] = lambda text: {},
    ) -> None:
        self.out, self.launcher, self.bounds, self.driver = out, launcher, bounds or Bounds(), driver
        self.args = list(ARGS if args is None else args)
        self.cwd, self.parse = cwd, parse
        self.scratch = Path(tempfile.mkdtemp(prefix="offload-crash-"))
        self.references: dict[tuple[str, ...], dict[str, Any]] = {}  # flags -> its uninterrupted run

    def close(self) -> None:
        """Remove the checkpoints (several GB over three entries)."""
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _argv(self, flags: tuple[str, ...], save_dir: Path, load: bool = False) -> list[str]:
        return [self.driver, *self.args, *flags, "--save", str(save_dir), *(["--load", str(save_dir)] if load else [])]

    def _run(self, name: str, run_name: str, argv: list[str], env: dict[str, str], watch: Watch | None = None) -> tuple:
        """One bounded run: what integration.py reads from its log and how it ended; and the log. Never
        raises: a run the drill could not start is a stopped run, which the entry's verdict names."""
        log = self.out / f"{name}-{run_name}.log"
        print(f"[{name}/{run_name}] {' '.join(self.launcher + argv)}", flush=True)
        try:
            outcome = run_bounded(
                self.launcher + argv,
                log,
                bound_s=self.bounds.run_s,
                env={**os.environ, **env},
                cwd=self.cwd,
                watch=watch,
                linger_s=self.bounds.linger_s,
            )
        except Exception as error:
            why = f"the drill could not run it: {type(error).__name__}: {error}"
            return {"returncode": None, "stopped": why, "verdict": f"{run_name} run: {why}", "left_behind": []}, ""
        result = self.parse(outcome.text) | {
            "returncode": outcome.returncode,
            "seconds": round(outcome.seconds, 1),
            "stopped": outcome.stopped,
            "verdict": verdict(run_name, outcome) if outcome.stopped else None,
            "killed_at_bound": outcome.killed,
            "left_behind": outcome.left_behind,
        }
        ended = "stopped: " + outcome.stopped if outcome.stopped else f"exit {outcome.returncode}"
        print(f"[{name}/{run_name}] {ended} after {outcome.seconds:.0f} s", flush=True)
        return result, outcome.text

    def run_entry(self, entry: CrashEntry, env: dict[str, str] | None = None) -> tuple[dict[str, dict], Verdict, dict]:
        """Uninterrupted (once per flags), killed and resumed, offloaded and control: the runs, the verdict
        and what was seen."""
        start, env, kill_at = time.monotonic(), dict(env or {}), KILL_AT[entry.mode]
        crash_env = {**env, "OFFLOAD_CRASH_AT": entry.mode, "OFFLOAD_CRASH_ITERATION": str(kill_at)}
        sides = {"": entry.flags, CONTROL: ()}  # run-name prefix -> flags
        save_dirs = {prefix: self.scratch / f"{entry.name}-{prefix or 'offloaded-'}save" for prefix in sides}
        calls = {}
        for prefix, flags in sides.items():
            if flags not in self.references:
                reference_dir = self.scratch / f"uninterrupted-{len(self.references)}"
                self.references[flags] = {"dir": reference_dir, "entry": entry.name}
                argv = self._argv(flags, reference_dir)
                calls[f"{prefix}uninterrupted"] = partial(self._run, entry.name, f"{prefix}uninterrupted", argv, env)
            watch = killed_run_watch(entry.mode, kill_at, self.bounds.after_kill_s)
            argv = self._argv(flags, save_dirs[prefix])
            calls[f"{prefix}killed"] = partial(self._run, entry.name, f"{prefix}killed", argv, crash_env, watch)
        done = together(calls)
        facts: dict[str, Any] = {}
        for prefix, flags in sides.items():
            if f"{prefix}uninterrupted" in done:
                self.references[flags]["result"], self.references[flags]["text"] = done[f"{prefix}uninterrupted"]
            facts[prefix or "offloaded"] = {
                "tracker_after_kill": last_complete_iteration(save_dirs[prefix]),
                "cut_short_after_kill": cut_short(save_dirs[prefix]),
                "left_behind_by_kill": done[f"{prefix}killed"][0]["left_behind"],
            }
        resumed = {
            f"{prefix}resumed": partial(
                self._run, entry.name, f"{prefix}resumed", self._argv(flags, save_dirs[prefix], load=True), env
            )
            for prefix, flags in sides.items()
        }
        done |= together(resumed)
        runs: dict[str, dict] = {}
        failures: list[str] = []
        differences: dict[str, Differences | None] = {}
        for prefix, flags in sides.items():
            reference = self.references[flags]
            if reference["entry"] != entry.name:
                facts[prefix or "offloaded"]["uninterrupted_run_of"] = reference["entry"]
            trio = {"uninterrupted": (reference["result"], reference["text"])}
            trio |= {run: done[f"{prefix}{run}"] for run in ("killed", "resumed")}
            runs |= {f"{prefix}{run}": result for run, (result, _) in trio.items()}
            logs = {run: text for run, (_, text) in trio.items()}
            side_facts = facts[prefix or "offloaded"]
            results = {run: result for run, (result, _) in trio.items()}
            found = check(entry.mode, kill_at, results, logs, side_facts, save_dirs[prefix], offloaded=bool(flags))
            failures += [f"without offloading: {f}" for f in found] if prefix else found
            loaded = side_facts["tracker_after_kill"] or 0
            compared = None if found else self._differences(reference, save_dirs[prefix], logs, loaded)
            differences[prefix or "offloaded"] = compared
        ours, control = differences["offloaded"], differences[CONTROL]
        result = judge(ours or {}, control, failures)
        facts["differences"] = {"offloaded": ours, "control": control}
        facts["entry_seconds"] = round(time.monotonic() - start, 1)
        if facts["entry_seconds"] > ENTRY_BUDGET_S:
            result.failures.append(f"the entry took {facts['entry_seconds']:.0f} s, over its {ENTRY_BUDGET_S:.0f} s")
            result.status = "FAIL"
        return runs, result, facts

    def _differences(self, reference: dict[str, Any], save_dir: Path, logs: dict[str, str], loaded: int) -> Differences:
        """Every value logged after the load and every final-checkpoint tensor of the resumed run that is not
        the uninterrupted one's."""
        found = logged_differences(logs["uninterrupted"], logs["resumed"], list(range(loaded + 1, TRAIN_ITERS + 1)))
        final = f"iter_{TRAIN_ITERS:07d}"
        complete = {"uninterrupted": is_complete(reference["dir"] / final), "resumed": is_complete(save_dir / final)}
        if not all(complete.values()):
            state = {run: "complete" if whole else "missing or incomplete" for run, whole in complete.items()}
            return found | {f"final checkpoint {final}": (state["uninterrupted"], state["resumed"])}
        try:
            if "tensors" not in reference:  # read once, compared with every entry's
                reference["tensors"] = fingerprints(reference["dir"] / final, self.scratch)
            found |= checkpoint_differences(reference["tensors"], fingerprints(save_dir / final, self.scratch))
        except Exception as error:  # a checkpoint that cannot be read is a difference, named, not a crash
            return found | {f"final checkpoint {final}": ("read", f"unreadable: {type(error).__name__}: {error}")}
        if not reference["tensors"]:
            found["final checkpoint"] = ("no tensors found", "no tensors found")
        return found
