"""Fixed GPU buffers that streamed layers take turns in, allocated once.

A slot remembers whose data it holds, so a layer used twice in a row (the last layer's forward, then
its recompute) or prefetched ahead is not copied again, and the choice of slot to reuse looks at the
known order of uses: the slot whose layer is needed last (or not at all) goes first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_offload.core.streams import Event
from megatron_offload.weights.plan import Unit

__all__ = ["Slot", "SlotRing"]


@dataclass(eq=False)
class Slot:
    buffer: torch.Tensor  # flat, typed
    unit: Unit | None = None  # whose data it holds, or is being filled with
    ready: Event | None = None  # the copy that fills it: the compute stream waits for it before use
    free_after: Event | None = None  # its copy to host: nothing may write the slot before it completed
    in_use: bool = False  # lent to the compute stream now
    views: dict[tuple[int, bool], list[torch.Tensor]] = field(default_factory=dict)

    def views_for(self, unit: Unit, grads: bool) -> list[torch.Tensor]:
        """The buffer's views shaped as ``unit``'s params (its weights or its gradients), made once."""
        key = (unit.index, grads)
        if key not in self.views:
            self.views[key] = [
                self.buffer[p.offset : p.offset + p.param.numel()].view(p.param.shape) for p in unit.placed
            ]
        return self.views[key]


class SlotRing:
    """``count`` buffers of ``numel`` elements of ``dtype``, from ``allocate(nbytes)``."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, allocate: Callable[[int], torch.Tensor]) -> None:
        size = torch.empty((), dtype=dtype).element_size()
        self.slots = [Slot(allocate(numel * size).view(dtype)) for _ in range(count)]

    @property
    def nbytes(self) -> int:
        return sum(slot.buffer.numel() * slot.buffer.element_size() for slot in self.slots)

    def pick(self, distance_of: Callable[[Unit], int], needed_in: int) -> Slot | None:
        """A slot to fill for a use ``needed_in`` uses from now: an empty one, else the one whose layer is
        used furthest away, if further than ``needed_in`` (else None: everything held is needed sooner)."""
        best, best_distance = None, needed_in
        for slot in self.slots:
            if slot.in_use:
                continue
            if slot.unit is None:
                return slot
            distance = distance_of(slot.unit)
            if distance > best_distance:
                best, best_distance = slot, distance
        return best

    def assign(self, slot: Slot, unit: Unit, attribute: str) -> None:
        """Give ``slot`` to ``unit`` (its ``weights_in`` or ``grads_in``), taking it from its holder."""
        if slot.unit is not None:
            setattr(slot.unit, attribute, None)
        slot.unit = unit
        setattr(unit, attribute, slot)

    def forget(self, attribute: str) -> None:
        """Drop what every slot holds (the host copies changed: an optimizer step ran)."""
        for slot in self.slots:
            if slot.unit is not None:
                setattr(slot.unit, attribute, None)
            slot.unit, slot.in_use = None, False
