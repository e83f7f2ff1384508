"""Does moving the optimizer state cost the training thread anything? Two torch.profiler chrome traces
of Megatron-LM iterations (``--profile --use-pytorch-profiler``), one without offloading and one with,
compared per profiled iteration.

Copies on side streams are free only if the compute stream stays as busy as without them. The
bar, on the compute stream (the stream with the most kernel time):

- busy time per iteration within 3% of no offload's (either way: more is extra work, less is work
  missing);
- in the windows where the copies run (windows of ``--window-ms`` from each ProfilerStep's start, in
  which device-to-host or host-to-device memcpy events of at least ``--min-copy-mib`` on other streams
  take at least ``--min-copy-share`` of the window), the busy share at most 10% below no offload's in the
  same windows (same offsets from the start of the same profiled iteration). Being busier there costs
  nothing, so only a drop fails.

Windows are aligned by time offset, as the bar defines them: where the offload iteration is longer,
its late windows have no counterpart: they are counted apart (``windows_beyond_base``, with the compute
stream's busy share in them) and named in the verdict, not compared. Profiled
iterations run slower than plain ones; the shares compare like with like, the times do not stand in
for ms/iter.

    python -m benchmarks.trace_summary NO_OFFLOAD_TRACE OFFLOAD_TRACE [--window-ms 25] [--json OUT]

Traces may be gzipped (Megatron writes ``rank-N.json.gz``). Exit status 0 when the bar is met, 1 when not,
2 when a trace cannot be read. Pure Python: runs anywhere the trace files are (read by profiler_trace.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.profiler_trace import MIB, Step, Trace, TraceError, load_trace

GIB = 1024**3
BUSY_TOLERANCE = 0.03
SHARE_TOLERANCE = 0.10


def _pairs(base: Trace, offload: Trace) -> list[tuple[Step, Step]]:
    """The same profiled iterations of both runs: by ProfilerStep number where both carry the same
    numbers, else in order."""
    by_number = {step.number: step for step in base.steps}
    if all(step.number in by_number for step in offload.steps):
        return [(by_number[step.number], step) for step in offload.steps]
    return list(zip(base.steps, offload.steps, strict=False))  # the shorter run's count


def compare(
    base: Trace,
    offload: Trace,
    window_ms: float = 25.0,
    min_copy_share: float = 0.1,
    busy_tolerance: float = BUSY_TOLERANCE,
    share_tolerance: float = SHARE_TOLERANCE,
) -> dict[str, Any]:
    """The bar's figures and verdict for one offload trace against the no-offload trace."""
    window = window_ms * 1e3
    iterations = []
    for base_step, step in _pairs(base, offload):
        base_busy = base.compute.busy(base_step.start, base_step.end)
        busy = offload.compute.busy(step.start, step.end)
        in_step = [c for c in offload.copy_events if c["start"] < step.end and c["end"] > step.start]
        windows = []
        beyond: list[tuple[float, float]] = []  # (compute busy, length) of copy windows with no counterpart
        for index in range(math.ceil((step.end - step.start) / window)):
            t0, t1 = step.start + index * window, min(step.start + (index + 1) * window, step.end)
            copy_share = offload.copies.busy(t0, t1) / (t1 - t0)
            if copy_share < min_copy_share or copy_share == 0:
                continue
            b0 = base_step.start + index * window
            b1 = min(b0 + window, base_step.end)
            if b1 <= b0:  # the offload iteration runs on past the end of the no-offload one
                beyond.append((offload.compute.busy(t0, t1), t1 - t0))
                continue
            windows.append(
                {
                    "offset_ms": index * window_ms,
                    "copy_share": copy_share,
                    "busy_us": offload.compute.busy(t0, t1),
                    "length_us": t1 - t0,
                    "base_busy_us": base.compute.busy(b0, b1),
                    "base_length_us": b1 - b0,
                }
            )
        for entry in windows:
            entry["share"] = entry["busy_us"] / entry["length_us"]
            entry["base_share"] = entry["base_busy_us"] / entry["base_length_us"]
        share = base_share = share_ratio = None
        if windows:  # pooled over the copy windows: long and short windows weigh by their length
            share = sum(w["busy_us"] for w in windows) / sum(w["length_us"] for w in windows)
            base_share = sum(w["base_busy_us"] for w in windows) / sum(w["base_length_us"] for w in windows)
            share_ratio = share / base_share if base_share > 0 else math.inf
        busy_ratio = busy / base_busy if base_busy > 0 else math.inf
        iterations.append(
            {
                "base_step": base_step.name,
                "step": step.name,
                "base_wall_ms": (base_step.end - base_step.start) / 1e3,
                "wall_ms": (step.end - step.start) / 1e3,
                "base_busy_ms": base_busy / 1e3,
                "busy_ms": busy / 1e3,
                "busy_ratio": busy_ratio,
                "busy_ok": abs(busy_ratio - 1) <= busy_tolerance,
                "d2h_GiB": sum(c["bytes"] for c in in_step if c["dir"] == "d2h") / GIB,
                "h2d_GiB": sum(c["bytes"] for c in in_step if c["dir"] == "h2d") / GIB,
                "copy_busy_ms": offload.copies.busy(step.start, step.end) / 1e3,
                "copy_windows": len(windows),
                "windows_beyond_base": len(beyond),
                "share_beyond_base": sum(b for b, _ in beyond) / sum(n for _, n in beyond) if beyond else None,
                "share": share,
                "base_share": base_share,
                "share_ratio": share_ratio,
                "share_ok": None if share_ratio is None else share_ratio >= 1 - share_tolerance,
                "windows": [
                    {key: w[key] for key in ("offset_ms", "copy_share", "share", "base_share")} for w in windows
                ],
            }
        )
    if not iterations:
        raise TraceError(f"{offload.path} and {base.path}: no profiled iterations to pair")
    failures = []
    if not all(it["busy_ok"] for it in iterations):
        failures.append(f"busy time off by more than {busy_tolerance:.0%}")
    if any(it["share_ok"] is False for it in iterations):
        failures.append(f"busy share in copy windows more than {share_tolerance:.0%} below no offload's")
    past = sum(it["windows_beyond_base"] for it in iterations)
    note = ""
    if past:  # not compared (nothing to compare with), but never hidden: copies that lengthen the iteration
        shares = [it["share_beyond_base"] for it in iterations if it["share_beyond_base"] is not None]
        note = (f" ({past} copy windows past the no-offload iteration's end, not compared: compute busy "
                f"{min(shares):.2f}-{max(shares):.2f} there)")  # fmt: skip
    return {
        "base": base.path,
        "offload": offload.path,
        "window_ms": window_ms,
        "min_copy_share": min_copy_share,
        "busy_tolerance": busy_tolerance,
        "share_tolerance": share_tolerance,
        "compute_stream": {"base": base.compute_stream, "offload": offload.compute_stream},
        "iterations": iterations,
        "passed": not failures,
        "verdict": ("pass" if not failures else "FAIL: " + "; ".join(failures)) + note,
    }


def _share(value: float | None) -> str:
    """A share or ratio in six columns; a dash where there were no copy windows to compare."""
    return f"{value:6.2f}" if value is not None else f"{'-':>6}"


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """One line per profiled iteration of each compared run, then its verdict."""
    head = (
        f"{'run':26} {'step':15} {'busy ms':>8} {'base ms':>8} {'ratio':>6} {'windows':>7} "
        f"{'share':>6} {'base':>6} {'ratio':>6} {'d2h/h2d GiB':>12}"
    )
    lines = [head]
    for name, summary in summaries.items():
        if "error" in summary:
            lines.append(f"{name:26} no trace summary: {summary['error'][:90]}")
            continue
        for it in summary["iterations"]:
            windows = f"{it['copy_windows']}" + (f"+{it['windows_beyond_base']}" if it["windows_beyond_base"] else "")
            lines.append(
                f"{name:26} {it['step']:15} {it['busy_ms']:8.1f} {it['base_busy_ms']:8.1f} {it['busy_ratio']:6.3f} "
                f"{windows:>7} {_share(it['share'])} {_share(it['base_share'])} {_share(it['share_ratio'])} "
                f"{it['d2h_GiB']:5.2f}/{it['h2d_GiB']:<6.2f}"
            )
        lines.append(f"{'':26} verdict: {summary['verdict']}")
    lines.append(
        "busy: compute-stream kernel time per profiled iteration; windows: copy windows compared (+ past the "
        "no-offload iteration's end); share: compute busy share in them"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the trace without offloading")
    parser.add_argument("offload", type=Path, help="the trace with offloading")
    parser.add_argument("--label", default="offload", help="the offload run's name in the table")
    parser.add_argument("--window-ms", type=float, default=25.0)
    parser.add_argument("--min-copy-mib", type=float, default=1.0, help="smaller memcpy events are not our copies")
    parser.add_argument("--min-copy-share", type=float, default=0.1, help="a copy window's least copy-busy share")
    parser.add_argument("--busy-tolerance", type=float, default=BUSY_TOLERANCE)
    parser.add_argument("--share-tolerance", type=float, default=SHARE_TOLERANCE)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    try:
        min_bytes = int(args.min_copy_mib * MIB)
        summary = compare(
            load_trace(args.base, min_bytes),
            load_trace(args.offload, min_bytes),
            window_ms=args.window_ms,
            min_copy_share=args.min_copy_share,
            busy_tolerance=args.busy_tolerance,
            share_tolerance=args.share_tolerance,
        )
    except TraceError as error:
        print(f"trace_summary: {error}", file=sys.stderr)
        return 2
    print(table({args.label: summary}), end="")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
