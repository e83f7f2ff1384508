"""Which slot a layer gets: an empty one before one whose layer is still needed, and of the empty ones the one
whose copy to host was queued first, so that a layer's backward never waits for the copy out of the layer
just before it while an older slot is free. Without a GPU: the copies are the host's; an unopened ``Gate`` is a
copy out still under way."""

from __future__ import annotations

import torch

from megatron_offload.core.streams import HostStreams
from megatron_offload.weights.slots import SlotRing
from tests.gates import Gate
from tests.weights.test_streamer import LAYERS, Model, batches, streamed


def ring(count: int = 3) -> SlotRing:
    return SlotRing(count, 8, torch.float32, HostStreams().block)


def test_of_the_empty_slots_the_one_emptied_first_is_picked() -> None:
    slots = ring()
    order = [slots.slots[2], slots.slots[0], slots.slots[1]]
    for slot in order:
        slots.copied_out(slot, Gate())
    assert slots.pick(lambda unit: 0, needed_in=0) is order[0]
    order[0].in_use = True
    assert slots.pick(lambda unit: 0, needed_in=0) is order[1]
    assert [slot.emptied for slot in order] == [1, 2, 3]


def test_a_slot_never_emptied_comes_before_one_with_a_copy_out() -> None:
    slots = ring(2)
    slots.copied_out(slots.slots[0], Gate())
    assert slots.pick(lambda unit: 0, needed_in=0) is slots.slots[1]


def test_consecutive_backward_layers_take_different_gradient_slots() -> None:
    """Each layer's gradients leave when its backward ends; the next layer's backward zeroes a slot for its own.
    With three gradient slots it must not take the one just emptied, whose copy out is the latest queued."""
    model = Model()
    streamer, _ = streamed(model)
    taken: list[tuple[int, int]] = []
    lend = streamer._lend

    def recording(unit, slot, grads):
        if grads and not unit.resident:
            taken.append((unit.index, streamer.grads.slots.index(slot)))
        lend(unit, slot, grads)

    streamer._lend = recording
    for tokens in batches(0, 2):
        taken.clear()
        model(tokens).backward()
        assert [index for index, _ in taken] == list(reversed(range(LAYERS)))
        slots = [slot for _, slot in taken]
        assert all(a != b for a, b in zip(slots, slots[1:], strict=False)), f"gradient slots by layer: {slots}"
        assert len(set(slots)) == 3
    streamer.settle()
