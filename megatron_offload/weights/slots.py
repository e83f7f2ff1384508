"""Fixed GPU buffers that streamed layers take turns in, allocated once.

A slot remembers whose data it holds, so a layer used twice in a row (the last layer's forward, then
its recompute) or prefetched ahead is not copied again, and the choice of slot to reuse looks at the
known order of uses: the slot whose layer is needed last (or not at all) goes first. Of the empty slots,
the one whose copy out was queued first goes first: copies out land in the order queued, so the compute
stream waits for none (a gradient slot is zeroed only once its copy out has read it), where taking the slot
just emptied would wait for the whole copy out of the layer before at every layer switch.
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
    emptied: int = 0  # when its latest copy to host was queued (the ring's count of them; 0: never)
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
        self.copies_out = 0  # copies to host queued from this ring's slots so far

    @property
    def nbytes(self) -> int:
        return sum(slot.buffer.numel() * slot.buffer.element_size() for slot in self.slots)

    def pick(self, distance_of: Callable[[Unit], int], needed_in: int) -> Slot | None:
        """A slot to fill for a use ``needed_in`` uses from now: an empty one (the one emptied first), else the
        one whose layer is used furthest away, if further than ``needed_in`` (else None: everything held is
        needed sooner)."""
        best, best_distance, empty = None, needed_in, None
        for slot in self.slots:
            if slot.in_use:
                continue
            if slot.unit is None:
                if empty is None or slot.emptied < empty.emptied:
                    empty = slot
                continue
            distance = distance_of(slot.unit)
            if distance > best_distance:
                best, best_distance = slot, distance
        return empty if empty is not None else best

    def copied_out(self, slot: Slot, done: Event) -> Event:
        """``slot``'s contents leave on a copy to host that completes at ``done``: nothing may write the slot
        before (``free_after``), and it counts as emptied now. Returns ``done``."""
        self.copies_out += 1
        slot.free_after, slot.emptied = done, self.copies_out
        return done

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
