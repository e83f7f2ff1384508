"""A stand-in for OffloadHandle and a four-layer forward for the pacing hooks' tests (no GPU): the offloads a
ledger the hooks drain or release, the allocator's readings the test's."""

from __future__ import annotations

import torch

from megatron_offload.core.units import GIB
from megatron_offload.megatron import pacing
from megatron_offload.optimizer_state.scheduler import Peaks, StateScheduler

__all__ = ["PROFILE", "Ledger", "forward", "learn"]


class Ledger:
    """Stands in for OffloadHandle: offloads holding ``pieces`` bytes, freed oldest first; kept state."""

    def __init__(self, limit: int) -> None:
        self.scheduler = StateScheduler(lambda: limit)
        self.pieces: list[int] = []
        self.kept = 0
        self.drained: list[int | None] = []  # host waits
        self.released: list[int | None] = []  # the compute stream's waits
        self.evicted: list[int] = []
        self.waits = 0
        self.pumps = 0
        self.quiet = False  # what the handle said at the latest step's end
        self.under_way = True  # copies other than ``pieces`` queued or in flight (copies in): every hook pumps

    def pump(self) -> None:
        self.pumps += 1

    @property
    def idle(self) -> bool:
        return not self.pieces and not self.under_way

    def moving_chunks(self) -> list[int]:
        return [GIB] * 64

    def pending_offload_bytes(self) -> int:
        return sum(self.pieces)

    def drain_offloads(self, nbytes: int | None = None) -> None:
        self.drained.append(nbytes)
        freed = 0
        while self.pieces and (nbytes is None or freed < nbytes):
            freed += self.pieces.pop(0)

    def release_offloads(self, nbytes: int | None = None) -> int:
        self.released.append(nbytes)
        freed = 0
        while self.pieces and (nbytes is None or freed < nbytes):
            freed += self.pieces.pop(0)
        return freed

    def kept_bytes(self) -> int:
        return self.kept

    def evict(self, nbytes: int) -> int:
        self.evicted.append(nbytes)
        self.quiet = False  # as the handle's evict: its copies out move from here on
        self.under_way = True  # released or not, they are in flight until a pump sees them landed
        moved, self.kept = self.kept, 0
        self.pieces.append(moved)
        return moved

    def count_hook_wait(self) -> None:
        self.waits += 1


def forward(model: torch.nn.Module, allocated: dict, readings: list[int]) -> None:
    """Run the model's pre-hooks with the allocator reading ``readings[i]`` at hook i."""
    for layer, reading in zip(model, readings, strict=True):
        allocated["bytes"] = reading
        layer(torch.zeros(1, 2))


PROFILE = [2 * GIB, 4 * GIB, 6 * GIB, 7 * GIB]  # what the forward needs without state


def learn(hooks, ledger, allocated, model, transient: int = 0) -> None:
    """Iteration 1: the profile (``transient``: a module between hooks 1 and 2 allocates that much more
    and frees it), then the reading of the natural peak at its step's end (8 GiB reserved)."""
    for index, (layer, reading) in enumerate(zip(model, PROFILE, strict=True)):
        if index == 2 and transient:
            allocated["bytes"] = PROFILE[1] + transient
            pacing.allocated_bytes()  # the allocator's peak sees it; no hook does
        allocated["bytes"] = reading
        layer(torch.zeros(1, 2))
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(8 * GIB, 8 * GIB), resident=0)
    hooks.new_iteration()
