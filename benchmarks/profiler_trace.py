"""One torch.profiler chrome trace of Megatron-LM iterations, read for trace_summary.py: the profiled
iterations (``ProfilerStep#N``), the compute stream (the stream with the most kernel time) and its busy
intervals, and the copies between host and device on the other streams. Pure Python, like trace_summary.py.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1024**2


class TraceError(ValueError):
    """A file that is not a chrome trace of profiled iterations, named in the message."""


@dataclass
class Intervals:
    """Disjoint, sorted busy intervals (µs) with running totals: the busy time in any span by bisection,
    so hundreds of windows over tens of thousands of kernels stay cheap."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    before: list[float] = field(default_factory=list)  # busy time of intervals 0..i-1

    @classmethod
    def merge(cls, spans: list[tuple[float, float]]) -> Intervals:
        """Union of possibly overlapping spans (overlap counts once: the stream is busy or it is not)."""
        merged = cls()
        total = 0.0
        for start, end in sorted(spans):
            if end <= start:
                continue
            if merged.ends and start <= merged.ends[-1]:
                if end > merged.ends[-1]:
                    total += end - merged.ends[-1]
                    merged.ends[-1] = end
                continue
            merged.starts.append(start)
            merged.ends.append(end)
            merged.before.append(total)
            total += end - start
        return merged

    def busy(self, t0: float, t1: float) -> float:
        """Busy time (µs) inside [t0, t1)."""
        if t1 <= t0 or not self.starts:
            return 0.0
        first = bisect.bisect_right(self.ends, t0)  # first interval ending after t0
        last = bisect.bisect_left(self.starts, t1)  # intervals [first, last) start before t1
        if first >= last:
            return 0.0
        end_of_last = self.before[last - 1] + (self.ends[last - 1] - self.starts[last - 1])
        total = end_of_last - self.before[first]
        total -= max(0.0, t0 - self.starts[first])
        total -= max(0.0, self.ends[last - 1] - t1)
        return total


@dataclass
class Step:
    """One profiled iteration: Megatron's ``ProfilerStep#N`` annotation on the training thread."""

    name: str
    start: float
    end: float

    @property
    def number(self) -> int | None:
        match = re.search(r"#(\d+)", self.name)
        return int(match[1]) if match else None


@dataclass
class Trace:
    """What the comparison needs of one trace: the steps, the compute stream's busy intervals, the copies."""

    path: str
    steps: list[Step]
    compute_stream: Any
    compute: Intervals
    copies: Intervals  # significant D2H/H2D copies on other streams, both directions together
    copy_events: list[dict[str, Any]]  # (start, end, bytes, direction) of each, for per-step sums


def stream_of(event: dict[str, Any]) -> Any:
    """The CUDA stream of a device event: ``args.stream`` where kineto writes it, else the row (tid)."""
    return (event.get("args") or {}).get("stream", event.get("tid"))


def correlation_of(event: dict[str, Any]) -> Any:
    """The id kineto gives a launch on the host and the kernel or copy it launched alike; None where it has none."""
    return (event.get("args") or {}).get("correlation")


def _direction(name: str) -> str | None:
    if "DtoH" in name or "Device -> Pinned" in name or "Device -> Pageable" in name:
        return "d2h"
    if "HtoD" in name or "Pinned -> Device" in name or "Pageable -> Device" in name:
        return "h2d"
    return None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The complete events (``ph`` X, with a start and a duration) of a chrome trace (``.json`` or
    ``.json.gz``)."""
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as handle:
            data = json.load(handle)
    except (OSError, EOFError, json.JSONDecodeError) as error:
        raise TraceError(f"{path}: not a readable chrome trace ({error})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{path}: no traceEvents list")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def load_trace(path: str | Path, min_copy_bytes: int = MIB, complete: list[dict[str, Any]] | None = None) -> Trace:
    """Read a chrome trace: ProfilerStep spans, the compute stream (most kernel time), its busy
    intervals, and the memcpy events of at least ``min_copy_bytes`` in either direction between host and
    device on any other stream. ``complete``: its events, read already (``read_events``)."""
    path = str(path)
    complete = read_events(path) if complete is None else complete
    steps = sorted(
        (
            Step(str(e["name"]), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in complete
            if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")
        ),
        key=lambda step: step.start,
    )
    if not steps:
        raise TraceError(f"{path}: no ProfilerStep# annotations (was it written by --use-pytorch-profiler?)")
    kernel_time: dict[Any, float] = {}
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    for kernel in kernels:
        kernel_time[stream_of(kernel)] = kernel_time.get(stream_of(kernel), 0.0) + float(kernel["dur"])
    if not kernel_time:
        raise TraceError(f"{path}: no kernel events (was CUDA activity recorded?)")
    compute_stream = max(kernel_time, key=kernel_time.__getitem__)
    compute = Intervals.merge(
        [(float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in kernels if stream_of(k) == compute_stream]
    )
    copy_events = []
    for event in complete:
        if event.get("cat") != "gpu_memcpy" or stream_of(event) == compute_stream:
            continue
        direction = _direction(str(event.get("name", "")))
        size = int((event.get("args") or {}).get("bytes", 0) or 0)
        if direction and size >= min_copy_bytes:
            start = float(event["ts"])
            copy_events.append({"start": start, "end": start + float(event["dur"]), "bytes": size, "dir": direction})
    copies = Intervals.merge([(c["start"], c["end"]) for c in copy_events])
    return Trace(path, steps, compute_stream, compute, copies, copy_events)
