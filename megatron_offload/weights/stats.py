"""What weight streaming moved and what it cost the compute stream, read without a sync."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_offload.core.streams import Event

__all__ = ["WeightStats"]


@dataclass
class WeightStats:
    bytes_in: int = 0  # weights, and running gradient sums from the second micro-batch on, to the GPU
    bytes_out: int = 0  # gradients to the host
    exposed_ms: float = 0.0  # time the compute stream stood waiting for a copy (CUDA events)
    gpu_bytes: int = 0  # the slots and resident copies, allocated once
    _waits: list[tuple[Event, Event]] = field(default_factory=list, repr=False)

    def add_wait(self, start: Event | None, end: Event | None) -> None:
        if start is not None and end is not None:
            self._waits.append((start, end))

    def harvest(self) -> WeightStats:
        """Add the waits that have completed by now (the rest stay for the next reading)."""
        pending = []
        for start, end in self._waits:
            if end.query():
                self.exposed_ms += start.elapsed_time(end)
            else:
                pending.append((start, end))
        self._waits = pending
        return self

    def snapshot(self) -> WeightStats:
        self.harvest()
        return WeightStats(self.bytes_in, self.bytes_out, self.exposed_ms, self.gpu_bytes)
