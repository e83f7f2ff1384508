"""Who holds the compute stream before the optimizer's update: one torch.profiler chrome trace of Megatron-LM
iterations (``--profile --use-pytorch-profiler``, best with ``--pytorch-profiler-collect-callstack``).

Per profiled iteration, the window from ``--before-ms`` before the update's first kernel (the kernels launched
inside the ranges named ``--range``, as in step_link.py) to the first copy out after it: the compute stream's idle
stretches longer than ``--gap-ms``, each marked ``host`` where the kernel after it started within ``HELD_US`` of its
launch (the GPU waited for the host to launch it) or ``device`` (it waited on the device: a copy, an event); with
Python stacks in the trace, the frames of the launching thread that overlap each host-held stretch by
``--frame-ms`` or more, nested under the frames that hold the whole stretch (the ``--depth`` outermost levels below
them). Between the last backward and the gradient norm, host-held idle is host work the loop put in the GPU's way.

    python -m benchmarks.step_start TRACE [--range Optimizer.step] [--before-ms 80] [--gap-ms 1] [--frame-ms 0.5]

Pure Python (profiler_trace.py reads the trace). Exit status 0, or 2 when the trace cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.profiler_trace import Trace, TraceError, correlation_of, load_trace, read_events, stream_of
from benchmarks.step_link import MS, step_spans

HELD_US = 100.0  # a kernel starting this soon after its launch was waiting for the host, not for the device


def _launches(complete: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Each launch (runtime or driver call) by its correlation id."""
    out = {}
    for event in complete:
        correlation = correlation_of(event)
        if event.get("cat") in ("cuda_runtime", "cuda_driver") and correlation is not None:
            out[correlation] = event
    return out


def compute_kernels(complete: list[dict[str, Any]], trace: Trace) -> list[dict[str, Any]]:
    """The compute stream's kernels, by start."""
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    stream = trace.compute_stream
    return sorted((k for k in kernels if stream_of(k) == stream), key=lambda k: k["ts"])


def stretches(kernels: list[dict[str, Any]], launches: dict, t0: float, t1: float, gap_ms: float) -> list[dict]:
    """The compute stream's idle stretches longer than ``gap_ms`` that end in [t0, t1] (one open at ``t0`` counted
    from there), each with who held it."""
    out, end = [], None
    for kernel in kernels:
        start, stop = float(kernel["ts"]), float(kernel["ts"]) + float(kernel["dur"])
        if stop <= t0:
            end = stop
            continue
        if start > t1:  # a kernel starting at t1 (the update's first) still closes the stretch before it
            break
        idle_from = None if end is None else max(end, t0)  # a stretch open as the window opens counts from there
        if idle_from is not None and start - idle_from > gap_ms * MS:
            launch = launches.get(correlation_of(kernel))
            lag = start - float(launch["ts"]) if launch is not None else None
            held = "unknown" if lag is None else "host" if lag <= HELD_US else "device"  # unknown: no launch recorded
            out.append({"start": idle_from, "end": start, "held": held, "next": str(kernel.get("name", ""))[:60]})
        end = stop if end is None else max(end, stop)
    return out


def frames_in(frames: list[dict[str, Any]], t0: float, t1: float, frame_ms: float, depth: int) -> list[tuple]:
    """(level, ms from t0, ms overlapping [t0, t1), name) of the frames overlapping the stretch by ``frame_ms`` or
    more, below the frames that hold all of it, down to ``depth`` levels under them, in start order."""
    near = sorted((f for f in frames if f["ts"] < t1 and f["ts"] + f["dur"] > t0), key=lambda f: (f["ts"], -f["dur"]))
    out, stack = [], []
    for frame in near:
        start, end = float(frame["ts"]), float(frame["ts"]) + float(frame["dur"])
        while stack and stack[-1][1] <= start:
            stack.pop()
        holders = sum(1 for s, e in stack if s <= t0 and e >= t1)
        stack.append((start, end))
        if start <= t0 and end >= t1:
            continue  # holds the whole stretch: the levels are counted under it
        level = len(stack) - 1 - holders
        overlap = min(end, t1) - max(start, t0)
        if level < depth and overlap >= frame_ms * MS:
            out.append((level, round((start - t0) / MS, 1), round(overlap / MS, 1), str(frame.get("name", ""))))
    return out


def summarize(path: str | Path, prefix: str, before_ms: float, gap_ms: float, frame_ms: float, depth: int) -> list:
    """One entry per profiled iteration (see the module's text); ``window`` None where no range launched a kernel."""
    complete = read_events(path)
    trace = load_trace(path, complete=complete)
    launches = _launches(complete)
    kernels = compute_kernels(complete, trace)
    correlations = (correlation_of(k) for k in kernels)
    threads = {launches[c]["tid"] for c in correlations if c in launches}  # those launching the compute stream's
    frames = [e for e in complete if e.get("cat") == "python_function" and e.get("tid") in threads]
    rows = []
    for step, span in zip(trace.steps, step_spans(complete, trace.steps, prefix), strict=True):
        row: dict[str, Any] = {"iteration": step.name, "window": None}
        rows.append(row)
        if span is None:
            continue
        update = span[0]
        outs = [c["start"] for c in trace.copy_events if c["dir"] == "d2h" and c["start"] >= update]
        t0, t1 = update - before_ms * MS, min(outs, default=update)
        found = stretches(kernels, launches, t0, max(t1, update), gap_ms)
        for stretch in found:
            held = stretch["held"] == "host"
            stretch["frames"] = frames_in(frames, stretch["start"], stretch["end"], frame_ms, depth) if held else []
        row["window"] = {
            "first_copy_out_ms": round((t1 - update) / MS, 1),
            "host_held_ms": round(sum(s["end"] - s["start"] for s in found if s["held"] == "host") / MS, 1),
            "device_held_ms": round(sum(s["end"] - s["start"] for s in found if s["held"] == "device") / MS, 1),
            "stretches": [
                {**s, "start": round((s["start"] - update) / MS, 1), "end": round((s["end"] - update) / MS, 1)}
                for s in found
            ],
        }
    return rows


def text(rows: list, prefix: str, before_ms: float) -> str:
    lines = []
    for row in rows:
        window = row["window"]
        if window is None:
            lines.append(f"{row['iteration']}: no range named {prefix}... launched a kernel")
            continue
        lines.append(
            f"{row['iteration']}: from {before_ms:g} ms before the update's first kernel to the first copy out "
            f"({window['first_copy_out_ms']:+.1f} ms): compute stream idle {window['host_held_ms']:.1f} ms waiting "
            f"for the host, {window['device_held_ms']:.1f} ms waiting on the device"
        )
        for stretch in window["stretches"]:
            lines.append(
                f"  {stretch['start']:+7.1f} to {stretch['end']:+7.1f} ms idle, held by the {stretch['held']}; "
                f"then {stretch['next']}"
            )
            for level, at, overlap, name in stretch["frames"]:
                lines.append(f"      {'  ' * level}{at:+6.1f} {overlap:5.1f} ms  {name[-100:]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--range", default="Optimizer.step", help="the annotations around the update: name prefix")
    parser.add_argument("--before-ms", type=float, default=80.0, help="how far before the update's first kernel")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="shortest idle stretch listed")
    parser.add_argument("--frame-ms", type=float, default=0.5, help="shortest overlap of a Python frame listed")
    parser.add_argument("--depth", type=int, default=3, help="levels of frames under those holding a stretch")
    args = parser.parse_args(argv)
    try:
        rows = summarize(args.trace, args.range, args.before_ms, args.gap_ms, args.frame_ms, args.depth)
    except TraceError as error:
        print(f"step_start: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(text(rows, args.range, args.before_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
