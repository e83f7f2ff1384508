"""Where the link stands while the optimizer step runs: one torch.profiler chrome trace of Megatron-LM
iterations (``--profile --use-pytorch-profiler``), read around each profiled iteration's step.

The step's span on the device is where the kernels launched inside the named ranges on the host ran: the
ranges are the ``user_annotation`` events whose name starts with ``--range`` (default ``Optimizer.step``,
the annotation torch's optimizers put around each ``step()``: megatron-core's inner Adam, once per group of
chunks where the step streams state), from the first to the last in the iteration, and kineto's
``correlation`` ids tie each kernel to its launch. Per iteration, in that span: its length and where it
starts, the compute stream's busy time, each copy direction's bytes and busy time; the same for the
``--before-ms`` before the span (the last backward, where state may come back early); and the
host-to-device link's idle gaps longer than ``--gap-ms`` inside the span, where the step could have been
bringing state in and was not; and how long the copies out it queued keep the device-to-host link busy past
its end, and which copies those are (how many, their size, when they started).

    python -m benchmarks.step_link TRACE [--range Optimizer.step] [--before-ms 80] [--gap-ms 1] [--json OUT]

Pure Python (profiler_trace.py reads the trace). Exit status 0, or 2 when the trace cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.profiler_trace import Intervals, Step, Trace, TraceError, correlation_of, load_trace, read_events

GIB = 1024**3
MS = 1000.0  # µs per ms: traces speak in µs


def _launch_spans(complete: list[dict[str, Any]]) -> dict[Any, tuple[float, float]]:
    """Each kernel's device span by its launch's correlation id."""
    spans = {}
    for event in complete:
        correlation = correlation_of(event)
        if event.get("cat") == "kernel" and correlation is not None:
            start = float(event["ts"])
            spans[correlation] = (start, start + float(event["dur"]))
    return spans


def step_spans(complete: list[dict[str, Any]], steps: list[Step], prefix: str) -> list[tuple[float, float] | None]:
    """For each profiled iteration, the device span of the kernels launched inside its ranges named
    ``prefix...`` (first range's start to last range's end), or None where it has none."""
    ranges = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in complete
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)
    )
    launches = sorted(
        (float(e["ts"]), correlation_of(e))
        for e in complete
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in str(e.get("name", ""))
    )
    kernels = _launch_spans(complete)
    spans: list[tuple[float, float] | None] = []
    for step in steps:
        inside = [(s, e) for s, e in ranges if step.start <= s < step.end]
        if not inside:
            spans.append(None)
            continue
        first, last = inside[0][0], max(e for _, e in inside)
        device = [kernels[c] for t, c in launches if first <= t <= last and c in kernels]
        spans.append((min(s for s, _ in device), max(e for _, e in device)) if device else None)
    return spans


Links = dict[str, tuple[list[dict[str, Any]], Intervals]]  # per direction: its copies, their busy intervals


def links(trace: Trace) -> Links:
    """Each copy direction's copies and their merged busy intervals, made once per trace."""
    out = {}
    for direction in ("h2d", "d2h"):
        copies = [c for c in trace.copy_events if c["dir"] == direction]
        out[direction] = (copies, Intervals.merge([(c["start"], c["end"]) for c in copies]))
    return out


def _link(link: Links, t0: float, t1: float) -> dict[str, dict[str, float]]:
    """Each direction's GiB (copies that start inside) and busy ms in [t0, t1)."""
    out = {}
    for direction, (copies, busy) in link.items():
        nbytes = sum(c["bytes"] for c in copies if t0 <= c["start"] < t1)
        out[direction] = {"GiB": round(nbytes / GIB, 3), "busy_ms": round(busy.busy(t0, t1) / MS, 2)}
    return out


def idle_gaps(busy: Intervals, t0: float, t1: float, gap_ms: float) -> list[tuple[float, float]]:
    """The stretches longer than ``gap_ms`` in [t0, t1) outside ``busy``: (ms from t0, ms long)."""
    gaps, at = [], t0
    for start, end in zip(busy.starts, busy.ends, strict=True):
        if end <= t0:
            continue
        if start >= t1:
            break
        if start - at > gap_ms * MS:
            gaps.append((round((at - t0) / MS, 1), round((start - at) / MS, 1)))
        at = max(at, end)
    if t1 - at > gap_ms * MS:
        gaps.append((round((at - t0) / MS, 1), round((t1 - at) / MS, 1)))
    return gaps


def busy_past(busy: Intervals, t1: float, gap_ms: float) -> float:
    """Ms ``busy`` runs on past ``t1`` (pauses up to ``gap_ms`` bridged). For the device-to-host link: the copies
    out the step queued; Megatron reads a value right after the step, and its 4-byte copy out waits behind them."""
    end = t1
    for start, stop in zip(busy.starts, busy.ends, strict=True):
        if stop <= t1:
            continue
        if start - end > gap_ms * MS:
            break
        end = max(end, stop)
    return round((end - t1) / MS, 1)


def tail(copies: list[dict[str, Any]], t1: float, after_ms: float) -> dict[str, float | int]:
    """The copies that keep the link busy past ``t1`` (for ``after_ms``, from ``busy_past``): how many, their GiB,
    the largest one's, and when the first and last of them started, in ms from ``t1`` (negative: before it)."""
    behind = [c for c in copies if c["end"] > t1 and c["start"] <= t1 + after_ms * MS]
    if not behind:
        return {"copies": 0, "GiB": 0.0, "largest_GiB": 0.0, "first_start_ms": 0.0, "last_start_ms": 0.0}
    return {
        "copies": len(behind),
        "GiB": round(sum(c["bytes"] for c in behind) / GIB, 3),
        "largest_GiB": round(max(c["bytes"] for c in behind) / GIB, 3),
        "first_start_ms": round((min(c["start"] for c in behind) - t1) / MS, 1),
        "last_start_ms": round((max(c["start"] for c in behind) - t1) / MS, 1),
    }


def summarize(path: str | Path, prefix: str = "Optimizer.step", before_ms: float = 80.0, gap_ms: float = 1.0) -> list:
    """One entry per profiled iteration (see the module's text); ``step`` None where no range was found."""
    complete = read_events(path)
    trace = load_trace(path, complete=complete)
    link = links(trace)
    rows = []
    for step, span in zip(trace.steps, step_spans(complete, trace.steps, prefix), strict=True):
        row: dict[str, Any] = {"iteration": step.name, "step": None}
        if span is not None:
            t0, t1 = span
            row["step"] = {
                "from_ms": round((t0 - step.start) / MS, 1),
                "length_ms": round((t1 - t0) / MS, 1),
                "compute_busy_ms": round(trace.compute.busy(t0, t1) / MS, 1),
                "link": _link(link, t0, t1),
                "before": _link(link, t0 - before_ms * MS, t0),
                "h2d_idle": idle_gaps(link["h2d"][1], t0, t1, gap_ms),
                "d2h_after_ms": busy_past(link["d2h"][1], t1, gap_ms),
            }
            row["step"]["d2h_tail"] = tail(link["d2h"][0], t1, row["step"]["d2h_after_ms"])
        rows.append(row)
    return rows


def text(rows: list, prefix: str, before_ms: float, gap_ms: float) -> str:
    lines = []
    for row in rows:
        step = row["step"]
        if step is None:
            lines.append(f"{row['iteration']}: no range named {prefix}... launched a kernel")
            continue
        link, before = step["link"], step["before"]
        gaps = " ".join(f"{at:g}+{length:g}" for at, length in step["h2d_idle"]) or "none"
        lines += [
            f"{row['iteration']}: the step on the device {step['length_ms']:.1f} ms, from {step['from_ms']:.1f} ms "
            f"into the iteration; compute stream busy {step['compute_busy_ms']:.1f} ms",
            f"  in the step: h2d {link['h2d']['GiB']:.2f} GiB, busy {link['h2d']['busy_ms']:.1f} ms | "
            f"d2h {link['d2h']['GiB']:.2f} GiB, busy {link['d2h']['busy_ms']:.1f} ms",
            f"  {before_ms:g} ms before it: h2d {before['h2d']['GiB']:.2f} GiB, busy {before['h2d']['busy_ms']:.1f} "
            f"ms | d2h {before['d2h']['GiB']:.2f} GiB, busy {before['d2h']['busy_ms']:.1f} ms",
            f"  h2d idle over {gap_ms:g} ms in the step (from+length, ms): {gaps}; d2h busy "
            f"{step['d2h_after_ms']:.1f} ms past its end",
        ]
        behind = step["d2h_tail"]
        if behind["copies"]:
            lines.append(
                f"  copies out past its end: {behind['copies']}, {behind['GiB']:.2f} GiB (largest "
                f"{behind['largest_GiB']:.2f}), started {behind['first_start_ms']:g} to {behind['last_start_ms']:g} "
                "ms from its end"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--range", default="Optimizer.step", help="the annotations around the step: name prefix")
    parser.add_argument("--before-ms", type=float, default=80.0, help="the span before the step also read")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="shortest h2d idle stretch listed")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    try:
        rows = summarize(args.trace, args.range, args.before_ms, args.gap_ms)
    except TraceError as error:
        print(f"step_link: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(text(rows, args.range, args.before_ms, args.gap_ms))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
