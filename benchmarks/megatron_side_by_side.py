"""Megatron-LM's own training loop (``megatron.training.pretrain``), with and without offloading, side
by side on one machine: the speed and the memory users see.

Clients: our ``scripts/pretrain_gpt.py``, and Megatron-LM's own ``pretrain_gpt.py`` (a checkout of
NVIDIA/Megatron-LM at the branch matching megatron-core, not part of this repository) through our
launcher. Time per iteration is Megatron's own "elapsed time per iteration" at each log interval, the
first interval (warm-up) left out; memory is Megatron's memory report and our log line; losses must
be bitwise the same as without offloading. Then under a GPU memory cap of the no-offload
peak less 90% of the state (``--offload-gpu-memory-cap-gib``): no offload must fail, every policy run;
under a cap of the no-offload peak less 50% of the state, ``--offload-fraction auto``. Each at every
``--log-intervals`` (Megatron synchronises the device at each logged iteration).

``--upstream-megatron-lm PATH`` (a copy of Megatron-LM's ``dev`` branch: its ``megatron`` package,
``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``) adds upstream's own offloader beside
ours: two rows run by upstream's own ``pretrain_gpt.py`` and loop, not through our launcher, with PATH
first on ``PYTHONPATH`` so that its megatron.core shadows the installed one; same model and flags, no
offload and ``--chunked-optimizer-state-offload``. Their ratios and losses are to upstream's own
no-offload row.

``--profile [NAME ...]`` adds a separate, profiled run of each named row (default: no offload, full
offload, prefetch step and, with upstream, its two rows) at the first log interval, under Megatron's
``--profile --use-pytorch-profiler``, and compares each offload trace with its no-offload trace
(``trace_summary.py``: compute-stream busy time and its share where copies run). Profiled iterations
run slower: their times are never the ms/iter of the table. ``--profile-only`` runs just those.

``--phases`` runs our rows through ``benchmarks/phases.py`` instead: CUDA events at each micro-batch's
forward and backward and at the step, no profiler, so the iterations are the timed ones; each row's JSON
gets its medians per phase (``phases_ms``), and the sweep's text each cap's difference to no offload.

``--sweep`` (memory_speed_curve.py) runs the memory-speed curve instead of the matrix: caps at the
no-offload peak reserved less ``--caps`` percents of the state, at the first of ``--log-intervals``: 24
iterations a run and ms/iter the median of iterations 3-24 at 1, 40 and the lines from iteration 10 at 5;
``--global-batch 8`` (4 micro-batches of 2) or 32 (16). Runs: one uncapped no
offload, one uncapped upstream, ours (the default) once per cap (no offload and upstream under a cap follow
from their uncapped runs). Estimate on one H100, start-up ~25 s (no offload), ~45-50 s (offloading) a run:
global batch 8, caps 90 75 50 25 without upstream: 5 runs, ~6 min; all five caps with upstream: 7 runs,
~8 min; global batch 32, caps 90 50: 4 runs, ~5.5 min (at interval 5, 40 iterations a run: more). Each run's JSON
and plot are written as it ends, so a call cut off still leaves the caps done. When nothing can run (no
CUDA GPU, no Megatron-LM script at ``--megatron-lm``, no megatron.training) it stops at once, one line.

    python -m benchmarks.megatron_side_by_side --megatron-lm PATH [--upstream-megatron-lm PATH]
        [--log-intervals 1 5] [--only NAME ...] [--profile [NAME ...]] [--profile-only]
    python -m benchmarks.megatron_side_by_side --megatron-lm PATH --sweep --global-batch 8 --caps 90 50 0
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from benchmarks import memory_speed_curve as curve
from benchmarks import phase_lines
from benchmarks.memory_report import GIB, MIB, parse_log
from benchmarks.run_logs import did_not_fit, failure_reason, logged_link_gbps
from benchmarks.trace_summary import TraceError, load_trace
from benchmarks.trace_summary import compare as compare_traces
from benchmarks.trace_summary import table as trace_table
from megatron_offload.config.files import expand_config_argv, needs_one_connection, preflight
from megatron_offload.core.units import cap_below_peak

ROOT = Path(__file__).resolve().parents[1]

OFFLOAD = ["--offload-optimizer-states"]
# Upstream's offloader (Megatron-LM dev, ChunkedOptimizerStateOffloader), with 512 MiB chunks. Its
# --offload-optimizer-states is a deprecated spelling of the same switch with chunk size 0: never given.
UPSTREAM_OFFLOAD = ["--chunked-optimizer-state-offload", "--optimizer-state-offload-chunk-size-mb", "512"]
# Megatron's torch.profiler schedule: iterations 7 and 8 recorded, well past start-up and auto's
# measuring iterations; the trace lands in TENSORBOARD_DIR/../torch_profile/rank-N.json.gz.
PROFILE_START, PROFILE_END = 7, 9


def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One training job under torchrun; its figures from the log. ``env_extra`` (upstream's rows) is
    written at the head of the log with the command, so that a log says how it was run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", **(env_extra or {})}
    if needs_one_connection(argv):
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core requires it with TP or CP > 1
    print(f"[{name}] {' '.join(argv)}", flush=True)
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    text = result.stdout + result.stderr
    prefix = "".join(f"{key}={value} " for key, value in (env_extra or {}).items())
    (out / f"{name}.log").write_text("$ " + prefix + " ".join(command) + "\n" + text)
    log = parse_log(text)
    figures: dict[str, Any] = {"argv": argv, "returncode": result.returncode, "wall_s": time.monotonic() - started}
    if log.parameters:  # Megatron's count on each model-parallel rank: the state is 12 bytes a parameter
        figures["parameters"] = max(log.parameters.values())
    if result.returncode != 0 or not log.steps:
        reason = failure_reason(text)
        print(f"[{name}] did not run: {reason}", flush=True)
        return figures | {"error": reason, "did_not_fit": did_not_fit(reason)}
    iterations = sorted(log.steps)
    steady = iterations[1:] or iterations  # the first interval holds the first, slow iterations
    last = log.steps[iterations[-1]]
    figures |= {
        "losses": {i: log.steps[i].loss for i in iterations},
        "step_ms": statistics.median(log.steps[i].step_ms for i in steady),
        "step_ms_per_interval": [log.steps[i].step_ms for i in iterations],
        "step_ms_by_iteration": {i: log.steps[i].step_ms for i in iterations},
        "offloaded_GiB": last.offloaded_gib,
        "exposed_ms": last.exposed_ms,
        "copy_out_in_ms": [last.copy_out_ms, last.copy_in_ms],
        "allocator_retries_by_iteration": {i: log.steps[i].allocator_retries for i in iterations},
        "streamed_GiB_by_iteration": {i: log.steps[i].streamed_gib for i in iterations},
    }
    if marked := phase_lines.summary(text):  # run through benchmarks.phases (--phases): GPU and host ms per phase
        figures["phases_ms"] = marked
    wanted = ("micro_batch_size", "global_batch_size", "data_parallel_size")
    figures["megatron_args"] = {key: log.args[key] for key in wanted if key in log.args}
    if link := logged_link_gbps(text):
        figures["link_GBps"] = link
    rank = log.memory_rank
    if rank is not None:
        memory = log.memory[rank][max(log.memory[rank])]
        figures["peak_allocated_GiB"] = memory.max_allocated * MIB / GIB
        figures["peak_reserved_GiB"] = memory.max_reserved * MIB / GIB
    ours = [(s.peak_allocated_gib, s.peak_reserved_gib) for s in log.steps.values() if s.peak_reserved_gib is not None]
    if ours:  # our log line's peaks per iteration: the run's peak, wherever Megatron's report fell
        figures["peak_allocated_GiB"] = max(figures.get("peak_allocated_GiB", 0), *(a or 0 for a, _ in ours))
        figures["peak_reserved_GiB"] = max(figures.get("peak_reserved_GiB", 0), *(r for _, r in ours))
    print(f"[{name}] {json.dumps({k: v for k, v in figures.items() if k not in ('argv', 'losses')})}", flush=True)
    return figures


def compare(runs: dict[str, Any], base: str, names: list[str] | None = None) -> None:
    """Ratios to ``base`` and bitwise loss equality, written into each run (of ``names``, else all)."""
    reference = runs[base]
    for name, figures in runs.items():
        if "error" in figures or "error" in reference or (names is not None and name not in names):
            continue
        figures["x_base"] = figures["step_ms"] / reference["step_ms"]
        figures["losses_equal"] = figures["losses"] == reference["losses"]


def table(results: dict[str, Any]) -> str:
    """Per log interval: ms/iter, the ratio to its base, peaks, exposed copy time, losses; then the
    profiled runs' trace comparison, if any."""
    head = f"{'run':26} {'ms/iter':>8} {'x base':>7} {'peak alloc':>10} {'peak resv':>10} {'cap':>6} {'exposed':>8}"
    lines = [f"{results.get('client', '')}, {results.get('config', '')}, commit {results.get('commit', '')}"]
    if results.get("upstream"):
        lines.append(
            f"upstream: {results['upstream']['path']}'s own pretrain_gpt.py and loop; x base and losses of its "
            f"rows are to '{UPSTREAM_BASE}', ours to 'no offload'"
        )
    for section, runs in results["runs"].items():
        lines += ["", section, head + "  losses"]
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"{name:26} did not run: {r['error'][:100]}")
                continue
            equal = "equal" if r.get("losses_equal", True) else "DIFFER"
            exposed = "-" if r.get("exposed_ms") is None else f"{r['exposed_ms']:.1f}"  # upstream logs none
            lines.append(
                f"{name:26} {r['step_ms']:8.1f} {r.get('x_base', 1):7.3f} {r.get('peak_allocated_GiB', 0):10.2f} "
                f"{r.get('peak_reserved_GiB', 0):10.2f} {r.get('cap_GiB', 0):6.2f} {exposed:>8}"
                f"  {equal}"
            )
    if "profiled" in results:
        lines += ["", f"profiled: {results['profiled']['note']}"]
        for name, r in results["profiled"]["runs"].items():
            outcome = f"did not run: {r['error'][:100]}" if "error" in r else f"trace {r['trace']}"
            lines.append(f"{name:26} {outcome}")
        lines += ["", "trace comparison (trace_summary.py), each against its base's trace"]
        lines.append(trace_table(results.get("trace", {})).rstrip("\n"))
    return "\n".join(lines) + "\n"


# The acceptance matrix, per log interval: (name, offload flags, cap as a share of the
# state taken off the no-offload peak; None: uncapped). The capped no-offload runs are meant to fail.
MATRIX = (
    ("no offload", None, None),
    ("full offload (auto)", [], None),
    ("prefetch step", ["--offload-prefetch", "step"], None),
    ("fraction auto", ["--offload-fraction", "auto"], None),
    ("cap 90%: no offload", None, 0.9),
    ("cap 90%: auto", ["--offload-prefetch", "auto"], 0.9),
    ("cap 90%: finalize", ["--offload-prefetch", "finalize"], 0.9),
    ("cap 90%: step", ["--offload-prefetch", "step"], 0.9),
    ("cap 50%: no offload", None, 0.5),
    ("cap 50%: fraction auto", ["--offload-fraction", "auto"], 0.5),
)
MEANT_TO_FAIL = ("cap 90%: no offload", "cap 50%: no offload")
# Upstream's rows (--upstream-megatron-lm): (name, flags); the first is their base.
UPSTREAM = (("upstream no offload", []), ("upstream chunked offload", UPSTREAM_OFFLOAD))
UPSTREAM_BASE = UPSTREAM[0][0]
# Rows a profiled run can be made of (uncapped: a cap needs the uncapped runs' figures), and the default.
PROFILABLE = tuple(name for name, _, cap in MATRIX if cap is None) + tuple(name for name, _ in UPSTREAM)
PROFILED = ("no offload", "full offload (auto)", "prefetch step")


def slug(name: str) -> str:
    """A row's name as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def prepare_upstream(path: Path) -> str:
    """Make upstream's start-up work from a ``git archive`` copy, and say how, for the results.

    Megatron's start-up runs ``make`` in megatron/core/datasets to build its C++ dataset helpers. An
    archive holds only the source, and the GPU machine may lack ``python3-config``, which the Makefile asks
    for the module's suffix. Where the installed megatron-core ships the module built from a byte-identical
    helpers.cpp, it is copied in (newer than the source, so make has nothing to do; ``upstream_env`` gives
    make the suffix); otherwise make builds it as upstream would."""
    if not (path / "pretrain_gpt.py").is_file():
        raise SystemExit(f"--upstream-megatron-lm {path}: no pretrain_gpt.py there (git archive dev megatron "
                         "pretrain_gpt.py gpt_builders.py model_provider.py)")  # fmt: skip
    datasets = path / "megatron" / "core" / "datasets"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if list(datasets.glob("helpers_cpp*")):
        return "upstream's dataset helpers: already built"
    for entry in sys.path:
        other = Path(entry or ".") / "megatron" / "core" / "datasets"
        built = other / f"helpers_cpp{suffix}"
        if other.resolve() == datasets.resolve() or not built.is_file() or not (datasets / "helpers.cpp").is_file():
            continue
        if (other / "helpers.cpp").is_file() and filecmp.cmp(other / "helpers.cpp", datasets / "helpers.cpp", False):
            shutil.copyfile(built, datasets / built.name)
            return f"upstream's dataset helpers: the installed megatron-core's module of the same helpers.cpp ({built})"
    return "upstream's dataset helpers: none prebuilt for the same source; upstream's start-up builds them (make)"


def upstream_env(path: Path, out: Path) -> dict[str, str]:
    """What upstream's runs get beside the environment: its folder first on PYTHONPATH (its megatron
    package shadows the installed one), make told the extension suffix (``prepare_upstream``), and the
    allocator setting our launcher gives our rows unless the caller chose one, so both sides run alike.
    Where there is no ``make`` but the helpers are built, a ``make`` that has nothing to do (written under
    ``out``) stands in, as the real one would have nothing to do."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(path.resolve()), os.environ.get("PYTHONPATH", "")) if p)}
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if suffix:
        env["MAKEFLAGS"] = " ".join(p for p in (os.environ.get("MAKEFLAGS", ""), f"LIBEXT={suffix}") if p)
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if shutil.which("make") is None and list((path / "megatron" / "core" / "datasets").glob("helpers_cpp*")):
        shim = out / "bin" / "make"
        shim.parent.mkdir(parents=True, exist_ok=True)
        shim.write_text("#!/bin/sh\necho 'make: no make here; the dataset helpers are built: nothing to be done'\n")
        shim.chmod(0o755)
        env["PATH"] = os.pathsep.join((str(shim.parent.resolve()), os.environ.get("PATH", "")))
    return env


def profile_plan(requested: list[str], upstream: bool) -> list[tuple[str, str | None]]:
    """The rows to profile, each with the row whose trace it is compared with (None: it is a base).
    An upstream row's base is upstream's no-offload trace where that is profiled, else ours, and the
    other way round; where no base is named, the first row's own is added."""
    names = list(dict.fromkeys(requested or PROFILED + ((UPSTREAM[0][0], UPSTREAM[1][0]) if upstream else ())))
    unknown = [n for n in names if n not in PROFILABLE or (n.startswith("upstream") and not upstream)]
    if unknown:
        raise SystemExit(f"--profile: not a profilable row: {', '.join(unknown)} (uncapped rows: "
                         f"{', '.join(PROFILABLE)}; upstream rows need --upstream-megatron-lm)")  # fmt: skip
    bases = ("no offload", UPSTREAM_BASE)
    if not any(n in bases for n in names):
        names.insert(0, UPSTREAM_BASE if names[0].startswith("upstream") else "no offload")
    plan: list[tuple[str, str | None]] = []
    for name in names:
        if name in bases:
            plan.append((name, None))
            continue
        own, other = (UPSTREAM_BASE, "no offload") if name.startswith("upstream") else ("no offload", UPSTREAM_BASE)
        plan.append((name, own if own in names else other))
    return plan


def summarize_traces(
    profiled: dict[str, Any], plan: list[tuple[str, str | None]], window_ms: float
) -> dict[str, dict[str, Any]]:
    """Each profiled offload run's trace against its base's (``trace_summary.compare``)."""
    summaries: dict[str, dict[str, Any]] = {}
    for name, base in plan:
        if base is None:
            continue
        traces = (profiled.get(base, {}).get("trace"), profiled.get(name, {}).get("trace"))
        if not all(traces):
            missing = [n for n, t in zip((base, name), traces, strict=True) if not t]
            summaries[name] = {"base_run": base, "error": f"no trace of {', '.join(missing)}"}
            continue
        try:
            summary = compare_traces(load_trace(traces[0]), load_trace(traces[1]), window_ms=window_ms)
        except TraceError as error:
            summaries[name] = {"base_run": base, "error": str(error)}
            continue
        summaries[name] = {"base_run": base, **summary}
    return summaries


def find_trace(folder: Path) -> str | None:
    """The lowest rank's trace Megatron wrote under ``folder/torch_profile``."""
    traces = sorted(folder.glob("torch_profile/rank-*.json*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    return str(traces[0]) if traces else None


def selected_upstream_rows(only: set[str], upstream: bool) -> list[tuple[str, list[str]]]:
    """Upstream's rows to run: none without a copy of upstream; with ``--only``, those it names, their
    base always with them."""
    if not upstream or (only and not only & {name for name, _ in UPSTREAM}):
        return []
    return [(name, flags) for name, flags in UPSTREAM if not only or name in only or name == UPSTREAM_BASE]


def run_matrix(args: argparse.Namespace, results: dict[str, Any], clients: dict[str, list[str]], env: dict) -> None:
    """The matrix at every log interval, our rows then upstream's, each compared with its own base."""
    upstream_rows = selected_upstream_rows(set(args.only or ()), "upstream" in clients)
    for interval in args.log_intervals:
        tail = ["--train-iters", str(args.train_iters), *args.extra, "--log-interval", str(interval)]
        argv = [*clients["ours"], *tail]
        runs: dict[str, Any] = {}
        for name, flags, cap_share in MATRIX:
            if args.only and name not in args.only and not (name == "no offload" and not args.caps_from):
                continue
            full = argv + ([] if flags is None else OFFLOAD + flags)
            if cap_share is not None:
                base, offload = runs.get("no offload", {}), runs.get("full offload (auto)", {})
                state = offload.get("offloaded_GiB") or results.get("state_GiB")
                if args.caps_from:
                    base, state = {"peak_allocated_GiB": args.caps_from[0]}, args.caps_from[1]
                if "error" in base or not state or "peak_allocated_GiB" not in base:
                    runs[name] = {"error": "no uncapped no-offload peak or state size to cap from"}
                    continue
                results["state_GiB"] = state
                cap = cap_below_peak(base["peak_allocated_GiB"], state, cap_share)
                results[f"cap {cap_share:.0%} GiB"] = cap
                full += ["--offload-gpu-memory-cap-gib", f"{cap:.3f}"]
            figures = run(f"log{interval}-{slug(name)}", full, args.gpus, args.out)
            runs[name] = figures | ({"cap_GiB": cap} if cap_share is not None else {})
        for name, flags in upstream_rows:
            upstream_argv = [*clients["upstream"], *tail, *flags]
            runs[name] = run(f"log{interval}-{slug(name)}", upstream_argv, args.gpus, args.out, env)
        if "no offload" in runs:
            compare(runs, "no offload", [name for name, _, _ in MATRIX])
        if UPSTREAM_BASE in runs:
            compare(runs, UPSTREAM_BASE, [name for name, _ in UPSTREAM])
        results["runs"][f"log-interval {interval}"] = runs
        (args.out / "side_by_side.json").write_text(json.dumps(results, indent=1, default=str))


def run_profiled(args: argparse.Namespace, results: dict[str, Any], clients: dict[str, list[str]], env: dict) -> None:
    """Separate profiled runs of the rows ``--profile`` names (at the first log interval, ``PROFILE_END + 1``
    iterations), then each offload trace against its base's."""
    plan = profile_plan(args.profile, "upstream" in clients)
    interval = args.log_intervals[0]
    profiled: dict[str, Any] = {}
    for name, _ in plan:
        folder = args.out / f"profiled-{slug(name)}"
        tail = [
            *("--train-iters", str(PROFILE_END + 1), *args.extra, "--log-interval", str(interval)),
            *("--profile", "--use-pytorch-profiler", "--profile-step-start", str(PROFILE_START)),
            *("--profile-step-end", str(PROFILE_END), "--tensorboard-dir", str(folder / "tensorboard")),
        ]
        if name in dict(UPSTREAM):
            argv, extra_env = [*clients["upstream"], *tail, *dict(UPSTREAM)[name]], env
        else:
            flags = next(f for n, f, _ in MATRIX if n == name)
            argv, extra_env = [*clients["ours"], *tail, *([] if flags is None else OFFLOAD + flags)], None
        figures = run(f"profiled-{slug(name)}", argv, args.gpus, args.out, extra_env)
        figures["trace"] = find_trace(folder)
        if "error" not in figures and not figures["trace"]:
            figures["error"] = f"no trace under {folder / 'torch_profile'}"
        profiled[name] = figures
    results["profiled"] = {
        "note": f"separate runs at --log-interval {interval}, iterations {PROFILE_START}-{PROFILE_END - 1} "
        "profiled: slower than plain ones, their times are not the table's ms/iter",
        "runs": profiled,
    }
    results["trace"] = summarize_traces(profiled, plan, args.window_ms)
    (args.out / "trace_summary.json").write_text(json.dumps(results["trace"], indent=1, default=str))
    (args.out / "trace_table.txt").write_text(trace_table(results["trace"]))


def failures(results: dict[str, Any]) -> list[str]:
    """The runs that did not do what they must: failed (or ran where meant to fail), losses not bitwise
    equal to their base's, a profiled run without its trace. The trace verdict is a finding, not one."""
    failed = [
        f"{section}: {name}"
        for section, runs in results["runs"].items()
        for name, figures in runs.items()
        if ("error" in figures) != (name in MEANT_TO_FAIL) or figures.get("losses_equal") is False
    ]
    profiled = results.get("profiled", {}).get("runs", {})
    return failed + [f"profiled: {name}" for name, figures in profiled.items() if "error" in figures]


def nothing_can_run(args: argparse.Namespace) -> str | None:
    """Why no run can start, in one line (no Megatron-LM script at the given path, a bad config file, no
    megatron.training, no CUDA GPU); None when runs can start."""
    if args.megatron_lm and not (args.megatron_lm / "pretrain_gpt.py").is_file():
        return f"--megatron-lm {args.megatron_lm}: no pretrain_gpt.py there (a checkout of NVIDIA/Megatron-LM)"
    return preflight(["--config", args.config])


def sweep(args: argparse.Namespace, results: dict[str, Any], clients: dict[str, list[str]], env: dict) -> int:
    """The memory-speed curve (memory_speed_curve.py): curve.json and curve.png under --out; status 1 when
    one of our offload rows did not run or its losses differ from no offload's."""
    estimate = curve.estimate_s(len(args.caps), (args.global_batch or 8) // 2, "upstream" in clients)
    runs = 1 + len(curve.OURS) * len(args.caps) + ("upstream" in clients)
    print(f"sweep: caps {args.caps}, about {estimate / 60:.1f} min ({runs} runs)", flush=True)
    flags = {"ours": OFFLOAD, "upstream": UPSTREAM_OFFLOAD}
    head = {key: results[key] for key in ("config", "client", "commit", "gpus", "upstream") if key in results}
    result = curve.run_sweep(args, clients, env, run, flags, head)
    if "error" in result:
        (args.out / "curve.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"megatron_side_by_side: sweep stopped: {result['error']}")
        return 1
    (args.out / "curve.txt").write_text(curve.table(result))
    print(curve.table(result), end="")
    bad = [f"cap {p['percent']}%: {name}" for p in result["caps"] for name in curve.OURS
           if p["rows"][name]["outcome"] != "ran" or p["rows"][name].get("losses_equal") is False]  # fmt: skip
    if bad:
        print(f"megatron_side_by_side: {len(bad)} of our runs did not run or differ in losses: {', '.join(bad)}")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout: its pretrain_gpt.py is run")
    parser.add_argument(
        "--upstream-megatron-lm",
        type=Path,
        help="a copy of Megatron-LM's dev branch (megatron/, pretrain_gpt.py, gpt_builders.py, model_provider.py): "
        "upstream's own offloader as two more rows, run by its own script and loop",
    )
    parser.add_argument("--config", default="configs/gpt_0p9b.yaml")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--log-intervals", type=int, nargs="+", default=[1, 5])
    parser.add_argument(
        "--only",
        nargs="*",
        help="names from the matrix or upstream's rows (default: all; 'no offload' always runs, and "
        "'upstream no offload' with any upstream row)",
    )
    parser.add_argument("--train-iters", type=int, default=15)
    parser.add_argument(
        "--caps-from",
        nargs=2,
        type=float,
        metavar=("PEAK_GIB", "STATE_GIB"),
        help="the uncapped no-offload peak allocated and the state (GiB) measured by an earlier call: caps are "
        "set from these, so the capped runs can go to a job of their own",
    )
    parser.add_argument(
        "--profile",
        nargs="*",
        metavar="NAME",
        help=f"also a separate profiled run of these rows (default: {', '.join(PROFILED)} and upstream's two), "
        "at the first log interval; each offload trace compared with its base's",
    )
    parser.add_argument("--profile-only", action="store_true", help="only the profiled runs (with --profile)")
    parser.add_argument("--window-ms", type=float, default=25.0, help="the trace comparison's window")
    parser.add_argument("--global-batch", type=int, help="--global-batch-size of every run (default: the config's)")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="our rows through benchmarks.phases: each iteration's phases (forwards, backwards, step) in GPU and "
        "host ms from CUDA events, their medians in the JSON and the curve's text (needs --megatron-lm)",
    )
    curves = parser.add_argument_group("the memory-speed curve (--sweep; memory_speed_curve.py)")
    curves.add_argument("--sweep", action="store_true", help="the cap sweep, not the matrix: curve.json, curve.png")
    curves.add_argument(
        "--caps",
        type=int,
        nargs="+",
        default=list(curve.DEFAULT_CAPS),
        metavar="PERCENT",
        help="caps: the no-offload peak reserved less these percents of the state (run in this order)",
    )
    curves.add_argument(
        "--link-gbps",
        type=float,
        default=curve.DEFAULT_LINK_GBPS,
        help="the host link for the floor when no run logs one (GB/s)",
    )
    curves.add_argument(
        "--first-forward-ms",
        type=float,
        help="the first micro-batch's forward for the floor "
        "(default: a third of a micro-batch's share of the no-offload iteration)",
    )
    curves.add_argument("--state-gib", type=float, help="the state per rank (default: 12 bytes a parameter)")
    curves.add_argument("--run-every-cell", action="store_true",
                       help="run no offload under every cap, also where its uncapped run tells")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "side-by-side")
    parser.add_argument("extra", nargs="*", help="more Megatron flags for every run (after --)")
    args = parser.parse_args()
    if args.profile_only and args.profile is None:
        parser.error("--profile-only needs --profile")
    if args.phases and not args.megatron_lm:
        parser.error("--phases marks Megatron-LM's own loop: give --megatron-lm PATH")
    problem = nothing_can_run(args)
    if problem:
        print(f"megatron_side_by_side: nothing can run: {problem}")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.megatron_lm:  # Megatron-LM's own script, through our launcher (with --phases, marked: phases.py)
        launcher = "benchmarks.phases" if args.phases else "megatron_offload.run"
        client = ["-m", launcher, str(args.megatron_lm / "pretrain_gpt.py")]
    else:
        client = ["scripts/pretrain_gpt.py"]
    if args.global_batch and not args.sweep:
        args.extra = ["--global-batch-size", str(args.global_batch), *args.extra]
    clients = {"ours": [*client, "--config", args.config]}
    results: dict[str, Any] = {"config": args.config, "gpus": args.gpus, "client": client[-1], "runs": {}}
    results["commit"] = os.environ.get("MEGATRON_OFFLOAD_COMMIT", "unknown")
    env: dict[str, str] = {}
    if args.upstream_megatron_lm:  # upstream's own script, loop and megatron.core; the config file as flags
        upstream = args.upstream_megatron_lm
        note = prepare_upstream(upstream)
        env = upstream_env(upstream, args.out)
        results["upstream"] = {"path": str(upstream), "note": note, "env": env}
        clients["upstream"] = [str(upstream / "pretrain_gpt.py"), *expand_config_argv(["--config", args.config])]
        print(f"upstream: {results['upstream']['note']}; env {env}", flush=True)
    if args.sweep:
        return sweep(args, results, clients, env)
    if not args.profile_only:
        run_matrix(args, results, clients, env)
    if args.profile is not None:
        run_profiled(args, results, clients, env)
    (args.out / "side_by_side.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "table.txt").write_text(table(results))
    print("\n" + table(results), end="")
    failed = failures(results)
    if failed:
        print(f"megatron_side_by_side: {len(failed)} run(s) did not do what they must: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
