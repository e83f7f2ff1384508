"""The nightly memory comparison's runs: its rows (RUN_FLAGS) and what each is for (run under the cap, must
not fit, judged, needed for a verdict, also run briefly with the allocator's history), each row's command, the
cap from the baseline's log, and running them one after another, each through nightly_runs.run_one: the judged
rows first (their record written before anything else runs), then the timeline reruns."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.host_pace import PaceLog
from benchmarks.memory_checks import CAP_FLAG
from benchmarks.memory_report import expected_state_bytes, parse_log
from benchmarks.memory_summary import summarize
from benchmarks.nightly_runs import RunProgress, environment, run_one

FLAG = "--offload-optimizer-states"
RUN_FLAGS = {
    "baseline": [],
    "step": [FLAG, "--offload-prefetch", "step"],
    "capped-no-offload": [],
    "capped-default": [FLAG],
    "baseline-again": [],  # no offload once more: with the first, it brackets the offload rows (memory_checks)
    "cpu-offload": ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
}
CAPPED = ("capped-no-offload", "capped-default")  # run under the cap, after the baseline measured it
MUST_NOT_FIT = ("capped-no-offload",)
REQUIRED = ("baseline", "step", "capped-default")  # judged; cpu-offload is only a reference
NEEDED = ("baseline", "step")  # without these two no check means anything: no verdict
CAP_STATE_SHARE = 0.5  # the cap: the baseline's peak reserved less this share of the optimizer state
TIMELINES = ("baseline", "step", "capped-default")  # each also run briefly with the allocator's history
TIMELINE_ITERS = 4  # the timeline runs' --train-iters: the warm-up, then steady iterations to take a window from
HISTORY = "--record-memory-history"


def flags_of(name: str, cap: float | None) -> list[str]:
    """A run's own flags: RUN_FLAGS, and the cap for the capped rows."""
    return [*RUN_FLAGS[name], *([CAP_FLAG, f"{cap:.2f}"] if name in CAPPED and cap is not None else [])]


def run_command(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """torchrun of scripts/pretrain_gpt.py, logging every iteration and its memory."""
    iters = ["--train-iters", str(args.iters)] if args.iters else []
    return [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus)],
        *["scripts/pretrain_gpt.py", "--config", str(args.config.resolve()), "--log-interval", "1"],
        *["--log-memory-interval", "1"],
        *iters,
        *flags_of(name, args.cap_gib),
        *extra,
    ]


def timeline_command(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """A row's command with the allocator's history and a snapshot each iteration, for TIMELINE_ITERS
    iterations: the last --train-iters wins in Megatron's argparse, so this one overrides --iters and the config."""
    snapshot = ["--memory-snapshot-path", str((args.out / f"{name}.snapshot.pickle").resolve())]
    return [*run_command(name, args, extra), HISTORY, *snapshot, "--train-iters", str(TIMELINE_ITERS)]


def cap_from(baseline_log: Path, extra: list[str]) -> tuple[float | None, str]:
    """The capped rows' cap from the baseline's log: its peak reserved less CAP_STATE_SHARE of the state,
    rounded down to 0.01 GiB; None and why when the log lacks either figure."""
    log = parse_log(baseline_log.read_text(errors="replace")) if baseline_log.is_file() else parse_log("")
    reserved = summarize(log).max_reserved_gib
    state, how = expected_state_bytes(log, "--no-offload-master-weights" not in extra)
    if reserved is None or state is None:
        return None, f"no cap: the baseline log gives no {'peak reserved' if reserved is None else how}"
    return math.floor((reserved - CAP_STATE_SHARE * state / 2**30) * 100) / 100, ""


def run_rows(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """The judged rows, one after another (the capped ones once the baseline gave the cap); returns the run
    record that --from-logs reads back, written to run_info.json before any timeline run."""
    args.out.mkdir(parents=True, exist_ok=True)
    names = [name for name in RUN_FLAGS if not (args.skip_cpu_offload and name == "cpu-offload")]
    info: dict[str, Any] = {"config": str(args.config), "gpus": args.gpus, "iters": args.iters, "extra_args": extra}
    info |= {"environment": environment(), "started": datetime.datetime.now().isoformat(timespec="seconds")}
    info["runs"], info["timeline_runs"] = {}, {}
    for name in TIMELINES:  # none left from an earlier night in the same folder
        (args.out / f"{name}.snapshot.pickle").unlink(missing_ok=True)
        (args.out / f"{name}.timeline.log").unlink(missing_ok=True)
    with RunProgress(names) as progress, PaceLog(args.out / "host-pace.txt"):  # the host's pace beside the rows
        for name in names:
            if name in CAPPED and args.cap_gib is None:
                args.cap_gib, why = cap_from(args.out / "baseline.log", extra)
                info["cap_gib"] = args.cap_gib
                if args.cap_gib is None:
                    info["runs"][name] = {"command": [], "returncode": None, "skipped": why}
                    continue
            command = run_command(name, args, extra)
            info["runs"][name] = {"command": command, "returncode": run_one(name, command, args, progress)}
    (args.out / "run_info.json").write_text(json.dumps(info, indent=1))
    return info


def run_timelines(args: argparse.Namespace, extra: list[str], info: dict[str, Any]) -> dict[str, Any]:
    """The short runs with the allocator's history, for the memory timeline plot, of the rows that ran
    through (a capped one only once a cap was found); the run record gains them and is written again."""
    names = [name for name in TIMELINES if name in info["runs"]]
    with RunProgress([f"{name}.timeline" for name in names]) as progress:
        for name in names:
            if info["runs"][name].get("returncode") != 0:
                progress.finish(f"{name}.timeline", "not run: its row did not run through")
                continue
            command = timeline_command(name, args, extra)
            code = run_one(f"{name}.timeline", command, args, progress)
            info["timeline_runs"][name] = {"command": command, "returncode": code}
    (args.out / "run_info.json").write_text(json.dumps(info, indent=1))
    return info
