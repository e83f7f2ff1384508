"""What the offloader measured: running totals, and the CUDA-event timings that fill them.

Copy and wait times are read from CUDA events once they have completed, never by a sync.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

__all__ = ["OffloadStats", "Timing", "Timings", "WaitClock", "totals"]

KINDS = ("offload", "prefetch", "exposed")  # copies out, copies back, the compute stream waiting for one


@dataclass
class OffloadStats:
    """Running totals. ``last_*`` figures are those of the latest step whose copies have all completed."""

    offloads: int = 0
    prefetches: int = 0
    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    bytes_streamed: int = 0  # came back through the streamed step rather than ahead of it
    offload_seconds: float = 0.0
    prefetch_seconds: float = 0.0
    exposed_seconds: float = 0.0  # the compute stream waiting for a prefetch: copy time not hidden
    last_offload_seconds: float = 0.0
    last_prefetch_seconds: float = 0.0
    last_exposed_seconds: float = 0.0
    gpu_bytes_freed: int = 0  # device memory released by the latest offload (0 while on the GPU)
    host_bytes: int = 0  # the planned state in the host slab: every byte that may be offloaded
    kept_bytes: int = 0  # state kept on the GPU across steps (``fraction`` below 1, or ``auto``'s)
    pinned: bool = True
    hook_waits: int = 0  # times a forward's hook had copies out waited for (on the device; on the host in iteration 1)
    step_backlog_bytes: int = 0  # offload copies still pending when the latest step returned
    allocator_retries: int = 0  # the caching allocator ran out of room under the limit (process-wide, since start)
    peak_allocated_bytes: int = 0  # ``torch.cuda.max_memory_allocated`` since its last reset
    peak_reserved_bytes: int = 0  # ``max_memory_reserved``: what the GPU really had to hold

    @property
    def offloaded_bytes(self) -> int:
        """State that leaves the GPU between steps."""
        return self.host_bytes - self.kept_bytes


def totals(readings: Iterable[OffloadStats]) -> OffloadStats:
    """Several offloaders' readings as one: counts of steps and the device's peaks are the largest, pinned
    only if all are, every other figure summed."""
    total = OffloadStats()
    for stats in readings:
        for field in fields(OffloadStats):
            value = getattr(stats, field.name)
            if field.name == "pinned":
                total.pinned = total.pinned and value
            elif field.name in ("offloads", "prefetches", "peak_allocated_bytes", "peak_reserved_bytes"):
                setattr(total, field.name, max(getattr(total, field.name), value))
            else:
                setattr(total, field.name, getattr(total, field.name) + value)
    return total


class Timing(NamedTuple):
    """One timed span on the device, between two CUDA events, of a ``kind`` (KINDS) and ``step``."""

    kind: str
    step: int
    start: Any
    end: Any


class Timings:
    """Adds completed timings into ``stats.<kind>_seconds`` and, per step, ``stats.last_<kind>_seconds``."""

    def __init__(self) -> None:
        self._pending: list[Timing] = []
        self._per_step: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}

    def add(self, kind: str, step: int, start: Any, end: Any) -> None:
        """A span of ``step`` between two recorded events; counted once both have completed."""
        self._pending.append(Timing(kind, step, start, end))

    def harvest(self, stats: OffloadStats) -> None:
        """Add up the timings whose events have completed (``query``, never a wait); keep the rest."""
        waiting = []
        for timing in self._pending:
            if not timing.end.query():
                waiting.append(timing)
                continue
            seconds = timing.start.elapsed_time(timing.end) / 1000
            name = f"{timing.kind}_seconds"
            setattr(stats, name, getattr(stats, name) + seconds)
            per_step = self._per_step[timing.kind]
            per_step[timing.step] = per_step.get(timing.step, 0.0) + seconds
        self._pending = waiting
        unfinished = {timing.step for timing in waiting}
        # A step's "last" figure is final once none of its copies is still running.
        for kind, per_step in self._per_step.items():
            complete = [step for step in per_step if step not in unfinished]
            if complete:
                newest = max(complete)
                setattr(stats, f"last_{kind}_seconds", per_step[newest])
                self._per_step[kind] = {s: v for s, v in per_step.items() if s >= newest}


class WaitClock:
    """How long the compute stream stood waiting for copies: each timed wait (``Streams.compute_waits``'s
    events) is added as it is queued and counted once its events have completed (``query``, never a wait).
    Past ``most_pending`` uncounted waits, adding one counts the completed ones, so a caller that never
    reads holds no more than that many events."""

    def __init__(self, most_pending: int = 256) -> None:
        self.ms = 0.0
        self._pending: list[tuple[Any, Any]] = []
        self._most_pending = most_pending

    def add(self, start: Any, end: Any) -> None:
        if start is None or end is None:  # streams that do not time (the CPU's)
            return
        self._pending.append((start, end))
        if len(self._pending) > self._most_pending:
            self.read()

    def read(self) -> float:
        """Milliseconds waited in the waits completed by now; the rest stay for a later reading."""
        pending = []
        for start, end in self._pending:
            if end.query():
                self.ms += start.elapsed_time(end)
            else:
                pending.append((start, end))
        self._pending = pending
        return self.ms
