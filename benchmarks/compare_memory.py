"""Nightly GPU-memory comparison: one Megatron-LM training configuration run several ways, then a verdict.

The runs (memory_runs.RUN_FLAGS): ``baseline`` (no offload); ``step`` (the smallest footprint, the whole optimizer state
off the GPU at the activation peak), whose peak allocated memory must be lower by at least
min_step_peak_saving_of_state of the state; ``capped-no-offload`` and ``capped-default`` under a cap of the
baseline's peak reserved less CAP_STATE_SHARE of the state: no offload must run out of memory there, the
default (``--offload-optimizer-states`` alone) must fit with its peak reserved under the cap; ``baseline-again``
(no offload after them: the floors' no-offload time brackets the offload rows, its losses bitwise too); ``cpu-offload``
(megatron-core's HybridDeviceOptimizer, a reference, often unavailable without TransformerEngine). Each
offload row's step time is held to its floor (benchmarks/memory_checks.py) and its losses to the
baseline's, bitwise. The limits are configs/nightly_thresholds.yaml. The judged runs record no allocator
history (it slows a step and widens its spread): memory_timeline.png comes from a short run of each of
TIMELINES that ran through, the same command with --record-memory-history for TIMELINE_ITERS iterations.
Beside the judged runs the host's pace is sampled (benchmarks/host_pace.py, DIR/host-pace.txt) and each row
says it over its steady iterations: on a host whose pace flips, rows that ran at different paces do not compare.

    python -m benchmarks.compare_memory --config configs/nightly_memory.yaml --out DIR [--gpus N] [--iters N] \\
        [--thresholds FILE] [-- EXTRA MEGATRON ARGS]
    python -m benchmarks.compare_memory --from-logs DIR      # re-parse DIR/<run>.log (+ snapshots), rewrite the report

Writes DIR/<run>.log, DIR/<name>.timeline.log and DIR/<name>.snapshot.pickle (the timeline runs),
host-pace.txt, run_info.json, report.json, report.md, and (with matplotlib) peak_memory.png and
memory_timeline.png. Exit status: 0 when every check passed, 1 when one failed, 2 on a usage error or when the
baseline or step run failed; a failed timeline run only leaves its line out of memory_timeline.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.memory_checks import ThresholdsError, cap_gib, evaluate, load_thresholds
from benchmarks.memory_markdown import render_markdown
from benchmarks.memory_plots import plot_peak_memory, plot_timeline, timelines
from benchmarks.memory_report import config_of, expected_state_bytes, parse_log, series
from benchmarks.memory_runs import (
    CAP_STATE_SHARE,
    CAPPED,
    HISTORY,
    MUST_NOT_FIT,
    NEEDED,
    REQUIRED,
    RUN_FLAGS,
    TIMELINE_ITERS,
    TIMELINES,
    flags_of,
    run_rows,
    run_timelines,
)
from benchmarks.memory_summary import read_runs, summarize
from benchmarks.nightly_runs import ROOT, environment


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and the Megatron arguments after ``--`` (passed to every run unchanged)."""
    split = argv.index("--") if "--" in argv else len(argv)
    own, extra = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="Megatron flags as YAML (scripts/pretrain_gpt.py --config)")
    parser.add_argument("--out", type=Path, help="output folder (default with --from-logs: that folder)")
    parser.add_argument("--gpus", type=int, default=1, help="processes per run (torchrun --nproc-per-node)")
    parser.add_argument("--iters", type=int, help="--train-iters for every run (default: the config's)")
    parser.add_argument("--thresholds", type=Path, default=ROOT / "configs" / "nightly_thresholds.yaml")
    parser.add_argument("--from-logs", type=Path, metavar="DIR", help="skip the runs; re-parse DIR/<run>.log")
    parser.add_argument("--skip-cpu-offload", action="store_true", help="leave the cpu-offload reference out")
    parser.add_argument("--timeout-min", type=float, default=60, help="kill a run (and its ranks) after this")
    args = parser.parse_args(own)
    if args.from_logs:
        if not args.from_logs.is_dir():
            parser.error(f"--from-logs {args.from_logs}: no such folder")
        args.out = args.out or args.from_logs
    else:
        if args.config is None or args.out is None:
            parser.error("--config and --out are needed (or --from-logs DIR)")
        if not args.config.is_file():
            parser.error(f"--config {args.config}: no such file (see configs/ for the shipped ones)")
        if args.gpus < 1 or (args.iters is not None and args.iters <= 2):
            parser.error("--gpus must be >= 1 and --iters > 2 (the first 2 iterations are warm-up)")
    try:
        args.limits = load_thresholds(args.thresholds)
    except ThresholdsError as error:
        parser.error(str(error))
    args.cap_gib = None
    return args, extra


def timeline_window(source: Path, name: str, summaries: dict[str, Any]) -> float | None:
    """The ms of allocator trace to plot for ``name``: one median step of its timeline run (its last step where
    the run is too short for a median); the row's own median where there is no timeline log (an older folder,
    whose snapshots the judged rows dumped)."""
    path = source / f"{name}.timeline.log"
    if not path.is_file():
        return summaries[name].median_step_ms
    log = parse_log(path.read_text(errors="replace"))
    window = summarize(log).median_step_ms or (log.steps[max(log.steps)].step_ms if log.steps else None)
    return window or summaries[name].median_step_ms


def write_plots(
    source: Path, out: Path, report: dict[str, Any], summaries: dict[str, Any], timeline_runs: dict[str, Any]
) -> None:
    """peak_memory.png and memory_timeline.png, or notes saying what is missing and why."""
    notes = report["notes"]
    failed = {name: run.get("returncode") for name, run in timeline_runs.items() if run.get("returncode") != 0}
    for name, code in failed.items():
        notes.append(f"memory_timeline.png leaves out {name}: its timeline run failed (exit {code})")
    names = [name for name in TIMELINES if name in summaries and name not in failed]
    windows = {name: timeline_window(source, name, summaries) for name in names}
    lines = timelines({name: source / f"{name}.snapshot.pickle" for name in names}, windows, notes)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        notes.append("no plots: matplotlib is not installed (pip install matplotlib)")
        return
    peaks = {name: run["summary"] for name, run in report["runs"].items()}
    plot_peak_memory(peaks, out / "peak_memory.png", report["measured"].get("cap_gib"))
    if lines:
        plot_timeline(lines, out / "memory_timeline.png")
    else:
        notes.append("no memory_timeline.png: no snapshot could be read")


def build_report(
    source: Path, args: argparse.Namespace, info: dict[str, Any], extra: list[str]
) -> tuple[dict[str, Any], int]:
    """Parse the logs in ``source``, judge, write report.json/.md and the plots to args.out; (report, exit code)."""
    out, runs_info = args.out, info.get("runs", {})
    logs, summaries = read_runs(source, list(RUN_FLAGS), runs_info, REQUIRED, MUST_NOT_FIT)
    notes: list[str] = []
    if "environment" not in info:
        notes.append("versions, commit and device were read when the report was made, not when the runs ran")
    extra = info.get("extra_args", extra)
    cap = next((cap_gib(logs[name]) for name in CAPPED if cap_gib(logs[name]) is not None), info.get("cap_gib"))
    sized = logs["step"] if logs["step"].parameters else logs["baseline"]  # the same model in both
    master = sized.args.get("offload_master_weights", "True") != "False" and "--no-offload-master-weights" not in extra
    state, how = expected_state_bytes(sized, master)
    measured, checks = evaluate(summaries, logs, state, cap, args.limits)
    runs = {
        name: {
            **runs_info.get(name, {}),
            "flags": flags_of(name, cap),
            "summary": dataclasses.asdict(summaries[name]),
            "series": series(log),
        }  # fmt: skip
        for name, log in logs.items()
    }
    failed = [name for name in NEEDED if summaries[name].status != "ok"]
    report: dict[str, Any] = {
        "generated": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": info.get("config") or config_of(logs["baseline"].command) or str(args.config),
        "gpus": info.get("gpus", args.gpus),
        "extra_args": extra,
        "environment": info.get("environment") or environment(),
        "thresholds": dataclasses.asdict(args.limits),
        "cap_state_share": CAP_STATE_SHARE,
        "state_bytes": state,
        "state_how": how,
        "measured": measured,
        "runs": runs,
        "checks": [] if failed else [dataclasses.asdict(check) for check in checks],
        "verdict": "ERROR" if failed else "PASS" if all(check.passed for check in checks) else "FAIL",
        "timeline_runs": info.get("timeline_runs", {}),
        "notes": notes,
    }
    for name in failed:
        notes.append(f"no verdict: the {name} run failed ({summaries[name].detail})")
    for name, run in runs_info.items():
        if run.get("skipped"):
            notes.append(f"{name} did not run: {run['skipped']}")
    if "cpu-offload" in logs:
        notes.append("cpu-offload is a reference (megatron-core's own offloader): not judged, losses not compared")
    commands = [run.get("command") or [] for run in runs_info.values()]
    commands += [(log.command or "").split() for log in logs.values()]  # --from-logs without run_info.json
    timeline_runs = info.get("timeline_runs", {})
    if any(HISTORY in command for command in commands):
        notes.append("step times include the allocator-history recording and Megatron's snapshot dump per iteration")
    elif timeline_runs or any(source.glob("*.timeline.log")):
        notes.append(
            "step times come from runs without the allocator's history; memory_timeline.png from separate "
            f"{TIMELINE_ITERS}-iteration runs with it"
        )
    write_plots(source, out, report, summaries, timeline_runs)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(render_markdown(report))
    return report, 2 if failed else 0 if report["verdict"] == "PASS" else 1


def print_verdict(report: dict[str, Any], out: Path) -> None:
    """The block a nightly log is read for: one line per run and per check, then the overall verdict."""
    print("\n=== nightly memory comparison: verdict ===")
    for name, run in report["runs"].items():
        s = run["summary"]
        print(f"  run {name:17} {s['status']}{': ' + s['detail'] if s['detail'] else ''}")
    for check in report["checks"]:
        result = "PASS" if check["passed"] else "FAIL"
        threshold = f"(threshold {check['threshold']})"
        print(f"  {result}  {check['name']:31} {check['measured']:>24}  {threshold} {check['detail']}".rstrip())
    failing = [check["name"] for check in report["checks"] if not check["passed"]]
    print(
        f"OVERALL: {report['verdict']}" + (f" ({', '.join(failing)})" if failing else "") + f"  report: {out}/report.md"
    )


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_logs:
        info_path = args.from_logs / "run_info.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        args.out.mkdir(parents=True, exist_ok=True)
    else:
        # The verdict first, then the timeline reruns and the report again with their plot: a night cut
        # short in those reruns keeps its report and the run record --from-logs rebuilds it from.
        info = run_rows(args, extra)
        build_report(args.out, args, info, extra)
        info = run_timelines(args, extra, info)
    report, code = build_report(args.from_logs or args.out, args, info, extra)
    print_verdict(report, args.out)
    return code


if __name__ == "__main__":
    sys.exit(main())
