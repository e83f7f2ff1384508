"""What weight streaming moved and what it cost the compute stream, read without a sync."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_offload.core.stats import WaitClock
from megatron_offload.core.streams import Event

__all__ = ["WeightStats"]


@dataclass
class WeightStats:
    bytes_in: int = 0  # weights, and running gradient sums from the second micro-batch on, to the GPU
    bytes_out: int = 0  # gradients to the host
    exposed_ms: float = 0.0  # time the compute stream stood waiting for a copy (CUDA events)
    gpu_bytes: int = 0  # the slots and resident copies, allocated once
    _waits: WaitClock = field(default_factory=WaitClock, repr=False)

    def add_wait(self, start: Event | None, end: Event | None) -> None:
        self._waits.add(start, end)

    def harvest(self) -> WeightStats:
        """Add the waits that have completed by now (the rest stay for the next reading)."""
        self.exposed_ms = self._waits.read()
        return self

    def snapshot(self) -> WeightStats:
        self.harvest()
        return WeightStats(self.bytes_in, self.bytes_out, self.exposed_ms, self.gpu_bytes)
