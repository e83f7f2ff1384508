"""Nightly GPU-memory comparison: one Megatron-LM training configuration run three ways, then a verdict.

The runs: ``baseline`` (no offloading), ``offload`` (--offload-optimizer-states) and ``cpu-offload``
(megatron-core's HybridDeviceOptimizer, a reference that may be unavailable without TransformerEngine).
Each log is parsed per iteration; the offload run's saving is compared with the optimizer state the
model's size implies, and the figures are judged against configs/nightly_thresholds.yaml.

    python -m benchmarks.compare_memory --config configs/nightly_memory.yaml --out DIR [--gpus N] [--iters N] \\
        [--thresholds FILE] [-- EXTRA MEGATRON ARGS]
    python -m benchmarks.compare_memory --from-logs DIR      # re-parse DIR/<run>.log (+ snapshots), rewrite the report

Writes DIR/report.json, report.md, peak_memory.png and memory_timeline.png, and DIR/thresholds_reached.yaml:
the thresholds file set from what this run reached (REACHED_* below say how much room each gets), to copy
over configs/nightly_thresholds.yaml after a first run on the nightly's machine. Exit status: 0 when every
threshold passed, 1 when one failed, 2 on a usage error or when the baseline or offload run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from benchmarks.memory_plots import plot_peak_memory, plot_timeline, timelines
from benchmarks.memory_report import (
    ThresholdsError,
    config_of,
    evaluate,
    expected_state_bytes,
    load_thresholds,
    read_runs,
    render_markdown,
    series,
)

ROOT = Path(__file__).resolve().parents[1]
# Thresholds from what a run reached (DIR/thresholds_reached.yaml): each figure with this much room, so a
# nightly on the same machine passes and a real regression does not. Set them once after a first GPU run.
REACHED_SAVING_ROOM = 0.05  # min_saving_fraction: the fraction reached, less this
REACHED_PEAK_ROOM = 0.8  # min_peak_saving_gib: this share of the peak saving reached
REACHED_OVERHEAD_ROOM = 0.10  # max_step_time_overhead: the overhead reached, plus this
RUN_FLAGS = {
    "baseline": [],
    "offload": ["--offload-optimizer-states"],
    "cpu-offload": ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
}
REQUIRED = ("baseline", "offload")  # the verdict needs these two; cpu-offload is only a reference
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


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
    return args, extra


def run_command(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """torchrun of scripts/pretrain_gpt.py, logging every iteration and dumping a memory snapshot."""
    iters = ["--train-iters", str(args.iters)] if args.iters else []
    return [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus)],
        *["scripts/pretrain_gpt.py", "--config", str(args.config.resolve()), "--log-interval", "1"],
        *["--log-memory-interval", "1", "--record-memory-history"],
        *["--memory-snapshot-path", str((args.out / f"{name}.snapshot.pickle").resolve())],
        *iters,
        *RUN_FLAGS[name],
        *extra,
    ]


class RunProgress:
    """One rich progress task per run on a terminal; one plain line per iteration elsewhere (CI logs)."""

    def __init__(self, names: list[str]) -> None:
        self.bars: Any = None
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            return
        if Console(stderr=True).is_terminal:
            columns = (TextColumn("{task.description:12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.bars = Progress(*columns, TextColumn("{task.fields[note]}"), console=Console(stderr=True))
            self.tasks = {name: self.bars.add_task(name, total=None, note="waiting") for name in names}

    def __enter__(self) -> RunProgress:
        if self.bars:
            self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars:
            self.bars.stop()

    def update(self, name: str, iteration: int, total: int, step_ms: str) -> None:
        if self.bars:
            self.bars.update(self.tasks[name], completed=iteration, total=total, note=f"{step_ms} ms/iter")
        else:
            print(f"[{name}] iteration {iteration}/{total} ({step_ms} ms)", file=sys.stderr, flush=True)

    def finish(self, name: str, note: str) -> None:
        if self.bars:
            self.bars.update(self.tasks[name], note=note)
        else:
            print(f"[{name}] {note}", file=sys.stderr, flush=True)


def run_one(name: str, command: list[str], args: argparse.Namespace, progress: RunProgress) -> int:
    """Run one configuration, streaming its output to DIR/<name>.log; its exit status."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    from megatron_offload.config.files import needs_one_connection

    if needs_one_connection(command):
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core requires it with TP or CP > 1
    options: dict[str, Any] = {"cwd": ROOT, "env": env, "text": True, "bufsize": 1, "start_new_session": True}
    with open(args.out / f"{name}.log", "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **options)

        def kill(reason: str) -> None:  # torchrun and its ranks share the process group started above
            if process.poll() is None:
                log.write(f"\n[compare_memory] {reason}: killing the run\n")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)

        # A hung NCCL job must not hang the nightly, nor outlive an interrupted one.
        watchdog = threading.Timer(args.timeout_min * 60, kill, (f"still running after {args.timeout_min} min",))
        watchdog.start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                if match := ITERATION.search(line):
                    progress.update(name, int(match[1]), int(match[2]), match[3])
            returncode = process.wait()
        finally:
            watchdog.cancel()
            kill("interrupted")
    progress.finish(name, "done" if returncode == 0 else f"exit {returncode}")
    return returncode


def environment() -> dict[str, str | None]:
    """Versions, repository commit and GPU name: the provenance line of the report."""

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def output(command: list[str]) -> str | None:
        try:
            return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = output(["git", "rev-parse", "HEAD"]) or os.environ.get("MEGATRON_OFFLOAD_COMMIT")
    if commit and output(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " (with uncommitted changes)"
    names = (output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) or "").splitlines()
    device = f"{len(names)} x {names[0]}" if len(set(names)) == 1 and len(names) > 1 else ", ".join(names)
    return {"torch": version("torch"), "megatron_core": version("megatron-core"), "commit": commit, "device": device}


def run_all(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """The three runs, one after another; returns the run record that --from-logs reads back."""
    args.out.mkdir(parents=True, exist_ok=True)
    names = [name for name in RUN_FLAGS if not (args.skip_cpu_offload and name == "cpu-offload")]
    info: dict[str, Any] = {"config": str(args.config), "gpus": args.gpus, "iters": args.iters, "extra_args": extra}
    info |= {"environment": environment(), "started": datetime.datetime.now().isoformat(timespec="seconds")}
    info["runs"] = {}
    with RunProgress(names) as progress:
        for name in names:
            (args.out / f"{name}.snapshot.pickle").unlink(missing_ok=True)
            command = run_command(name, args, extra)
            info["runs"][name] = {"command": command, "returncode": run_one(name, command, args, progress)}
    (args.out / "run_info.json").write_text(json.dumps(info, indent=1))
    return info


def write_plots(source: Path, out: Path, report: dict[str, Any], summaries: dict[str, Any]) -> None:
    """peak_memory.png and memory_timeline.png, or notes saying what is missing and why."""
    notes = report["notes"]
    windows = {name: summaries[name].median_step_ms for name in REQUIRED}
    lines = timelines({name: source / f"{name}.snapshot.pickle" for name in REQUIRED}, windows, notes)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        notes.append("no plots: matplotlib is not installed")
        return
    plot_peak_memory({name: run["summary"] for name, run in report["runs"].items()}, out / "peak_memory.png")
    if lines:
        plot_timeline(lines, out / "memory_timeline.png")
    else:
        notes.append("no memory_timeline.png: no snapshot could be read")


def build_report(
    source: Path, args: argparse.Namespace, info: dict[str, Any], extra: list[str]
) -> tuple[dict[str, Any], int]:
    """Parse the logs in ``source``, judge, write report.json/.md and the plots to args.out; (report, exit code)."""
    out, runs_info = args.out, info.get("runs", {})
    logs, summaries = read_runs(source, list(RUN_FLAGS), REQUIRED, runs_info)
    notes: list[str] = []
    if "environment" not in info:
        notes.append("versions, commit and device were read when the report was made, not when the runs ran")
    report: dict[str, Any] = {
        "generated": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": info.get("config") or config_of(logs["baseline"].command) or str(args.config),
        "gpus": info.get("gpus", args.gpus),
        "extra_args": info.get("extra_args", extra),
        "environment": info.get("environment") or environment(),
        "thresholds": dataclasses.asdict(args.limits),
        "runs": {
            name: {**runs_info.get(name, {}), "summary": dataclasses.asdict(summaries[name]), "series": series(log)}
            for name, log in logs.items()
        },
        "notes": notes,
    }
    failed = [name for name in REQUIRED if summaries[name].status != "ok"]
    sized = logs["offload"] if logs["offload"].parameters else logs["baseline"]  # the same model in both
    master = logs["offload"].args.get("offload_master_weights", "True") != "False"
    master = master and "--no-offload-master-weights" not in report["extra_args"]
    expected, how = expected_state_bytes(sized, master)
    measured, checks = evaluate(summaries, logs, expected, args.limits)
    report["saving"] = {**measured, "expected_bytes": expected, "expected_how": how}
    report["checks"] = [] if failed else [dataclasses.asdict(check) for check in checks]
    report["verdict"] = "ERROR" if failed else "PASS" if all(check.passed for check in checks) else "FAIL"
    for name in failed:
        notes.append(f"no verdict: the {name} run failed ({summaries[name].detail})")
    if runs_info or any(source.glob("*.snapshot.pickle")):
        notes.append("step times include the allocator-history recording and Megatron's snapshot dump per iteration")
    write_plots(source, out, report, summaries)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(render_markdown(report))
    return report, 2 if failed else 0 if report["verdict"] == "PASS" else 1


def thresholds_reached(report: dict[str, Any]) -> str | None:
    """configs/nightly_thresholds.yaml's keys set from what this run reached (with the REACHED_* room), as
    YAML for the lead to copy over the shipped file (or pass with --thresholds); None without a verdict."""
    saving = report.get("saving") or {}
    figures = [saving.get(key) for key in ("saving_fraction", "peak_saving_gib", "step_time_overhead")]
    if report.get("verdict") == "ERROR" or any(figure is None for figure in figures):
        return None
    fraction, peak, overhead = figures
    equal = next((c["passed"] for c in report.get("checks", []) if c["name"] == "losses_equal"), True)
    return "\n".join(
        [
            "# Thresholds from what one run reached (benchmarks/compare_memory.py, REACHED_* room):",
            f"# {report['environment'].get('device')}, commit {report['environment'].get('commit')}",
            f"# {report['generated']}",
            f"# reached: saving fraction {fraction:.3f}, peak saving {peak:.2f} GiB, step overhead {overhead:+.1%}",
            f"min_saving_fraction: {max(fraction - REACHED_SAVING_ROOM, 0):.2f}",
            f"min_peak_saving_gib: {max(peak * REACHED_PEAK_ROOM, 0):.2f}",
            f"max_step_time_overhead: {max(overhead, 0) + REACHED_OVERHEAD_ROOM:.2f}",
            f"losses_equal: {'true' if equal else 'false'}",
            "",
        ]
    )


def print_verdict(report: dict[str, Any], out: Path) -> None:
    """The block a nightly log is read for: one line per threshold, then the overall verdict."""
    print("\n=== nightly memory comparison: verdict ===")
    for name, run in report["runs"].items():
        s = run["summary"]
        print(f"  run {name:12} {s['status']}{': ' + s['detail'] if s['detail'] else ''}")
    for check in report["checks"]:
        result = "PASS" if check["passed"] else "FAIL"
        threshold = f"(threshold {check['threshold']})"
        print(f"  {result}  {check['name']:24} {check['measured']:>12}  {threshold} {check['detail']}".rstrip())
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
        info = run_all(args, extra)
    report, code = build_report(args.from_logs or args.out, args, info, extra)
    print_verdict(report, args.out)
    reached = thresholds_reached(report)
    if reached is not None:
        (args.out / "thresholds_reached.yaml").write_text(reached)
        print(f"thresholds from this run: {args.out}/thresholds_reached.yaml (copy over {args.thresholds} to adopt)")
    return code


if __name__ == "__main__":
    sys.exit(main())
