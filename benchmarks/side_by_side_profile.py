"""The profiled runs of megatron_side_by_side.py (``--profile``): which rows, each with the row its trace is
compared with; separate runs under Megatron's torch.profiler; and each offload trace against its base's
(trace_summary.py), into trace_summary.json and trace_table.txt."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from benchmarks import megatron_job as job
from benchmarks.profiler_trace import TraceError, load_trace
from benchmarks.side_by_side_rows import MATRIX, OFFLOAD, PROFILABLE, PROFILED, UPSTREAM, UPSTREAM_BASE, slug
from benchmarks.trace_summary import compare as compare_traces
from benchmarks.trace_summary import table as trace_table

# Megatron's torch.profiler schedule: iterations 7 and 8 recorded, well past start-up and auto's
# measuring iterations; the trace lands in TENSORBOARD_DIR/../torch_profile/rank-N.json.gz.
PROFILE_START, PROFILE_END = 7, 9


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
        figures = job.run(f"profiled-{slug(name)}", argv, args.gpus, args.out, extra_env)
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
