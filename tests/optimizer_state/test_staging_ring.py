"""Where the streamed step puts each streamed chunk in its staging buffers (``staging_ring.places``), on the CPU.

What it proves: chunks of one size take turns through the three buffers as before (each reuses the one three
before it); uneven chunks follow one another through the buffers, so that after one large chunk the copies in
of the small ones need not wait for its copy out; a large chunk among small ones takes two buffers, not three,
while the step's footprint still counts three; every place lies inside its buffer, aligned;
a chunk waits for the latest earlier chunk whose bytes it overlaps, never for one the host has not queued out yet
when it queues this copy in (of three buffers the two before it, of two the one before it); and the streamed
step so placed matches the optimizer's own step bit for bit, its copies in waiting for exactly those copies out.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_offload.core.streams import OFFLOAD, PREFETCH, HostStreams
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from megatron_offload.optimizer_state.plan import ALIGN
from megatron_offload.optimizer_state.staging_ring import buffers_for, places
from tests.optimizer_state.cpu_engine import (
    adam_with_masters,
    assert_same_training_state,
    offloader_for,
    set_grads,
)


def overlaps(a, b) -> bool:
    return a.buffer == b.buffer and a.offset < b.offset + b.size and b.offset < a.offset + a.size


def test_chunks_of_one_size_take_turns_through_the_three_buffers() -> None:
    found = places([ALIGN * 4] * 7, ALIGN * 4, 3)
    assert [(p.buffer, p.offset) for p in found] == [(i % 3, 0) for i in range(7)]
    assert [p.reuses for p in found] == [None, None, None, 0, 1, 2, 3]


def test_after_a_large_chunk_the_small_ones_fill_the_other_buffers() -> None:
    large, small = 16 * ALIGN, ALIGN
    found = places([large, *[small] * 40], large, 3)
    assert found[0].buffer == 0
    assert [p.buffer for p in found[1:33]] == [1] * 16 + [2] * 16  # 32 small chunks without reusing any bytes
    assert all(p.reuses is None for p in found[:33])
    assert found[33].buffer == 0 and found[33].reuses == 0  # the large chunk's bytes: only once it has left


@pytest.mark.parametrize("seed", range(30))
def test_every_chunk_waits_for_the_latest_earlier_chunk_on_its_bytes(seed: int) -> None:
    generator = random.Random(seed)
    sizes = [generator.choice([1, 3, 7, 64, 200, 256]) * ALIGN - generator.randrange(ALIGN) for _ in range(60)]
    capacity = max(sizes) + generator.randrange(3) * ALIGN
    found = places(sizes, capacity, 3)
    for index, place in enumerate(found):
        assert place.size == sizes[index] and place.offset % ALIGN == 0
        assert place.offset >= 0 and place.offset + place.size <= capacity and 0 <= place.buffer < 3
        earlier = [k for k in range(index) if overlaps(found[k], place)]
        assert place.reuses == max(earlier, default=None)
        assert place.reuses is None or place.reuses <= index - 3


def test_a_large_chunk_among_small_ones_takes_two_buffers_chunks_of_one_size_three() -> None:
    assert buffers_for([ALIGN * 4] * 7, 3) == 3
    assert buffers_for([ALIGN * 8, ALIGN * 8, ALIGN * 4, ALIGN], 3) == 2  # the third fits twice in the first
    assert buffers_for([ALIGN * 8, ALIGN * 8, ALIGN * 4 + 1, ALIGN], 3) == 3  # aligned, it does not
    assert buffers_for([ALIGN * 8, ALIGN, ALIGN], 3) == 2
    assert buffers_for([ALIGN * 8, ALIGN], 3) == 2 and buffers_for([ALIGN], 3) == 1 and buffers_for([], 3) == 0
    assert buffers_for([ALIGN * 8, ALIGN, ALIGN], 1) == 1
    # Sizes come in update order: the largest and the third largest are found wherever they stand.
    assert buffers_for([ALIGN * 4, ALIGN, ALIGN * 8, ALIGN * 8], 3) == 2
    assert buffers_for([ALIGN * 8, ALIGN * 8, ALIGN * 2, ALIGN * 8], 3) == 3


@pytest.mark.parametrize("seed", range(30))
def test_of_two_buffers_a_chunk_never_waits_for_the_one_before_it(seed: int) -> None:
    generator = random.Random(seed)
    large = generator.choice([8, 16, 64]) * ALIGN
    sizes = [large] * generator.randrange(1, 3) + [
        generator.randrange(1, large // 2 // ALIGN + 1) * ALIGN - generator.randrange(ALIGN) for _ in range(50)
    ]
    assert buffers_for(sizes, 3) == 2
    found = places(sizes, large, 2)
    for index, place in enumerate(found):
        assert place.offset + place.size <= large and place.buffer in (0, 1)
        earlier = [k for k in range(index) if overlaps(found[k], place)]
        assert place.reuses == max(earlier, default=None)
        assert place.reuses is None or place.reuses <= index - 2


def test_a_chunk_larger_than_the_buffers_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold a chunk"):
        places([ALIGN, 3 * ALIGN], 2 * ALIGN, 3)


class Dependencies(HostStreams):
    """Copies at once, as HostStreams, recording each copy's direction and the event it waits for; its end
    event is its index in that record."""

    def __init__(self) -> None:
        self.copies: list[tuple[str, object]] = []

    def copy(self, direction, pairs, after):
        super().copy(direction, pairs, after)
        self.copies.append((direction, after))
        return None, Done(len(self.copies) - 1)


class Done:
    """A copy's end that reads as still running until waited for, so that copies queued behind it name it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def uneven_pair():
    torch.manual_seed(0)
    reference, _ = adam_with_masters((2000, *[150] * 40))
    torch.manual_seed(0)
    optimizer, masters = adam_with_masters((2000, *[150] * 40))
    streams = Dependencies()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, streams=streams)
    offloader.offload()
    offloader.copies.drain()  # landed: the chunks are in host memory, none still leaving
    return reference, optimizer, offloader, streams


def test_the_streamed_step_over_uneven_chunks_matches_the_plain_step() -> None:
    """One parameter's state is many chunks' size: the step streams through the ring, bit for bit."""
    reference, optimizer, offloader, streams = uneven_pair()
    stepper = ChunkStepper(optimizer)
    for step in range(4):
        set_grads(reference, step)
        reference.step()
        set_grads(optimizer, step)
        with offloader.device_view.params_on_device():
            streamed_step.run(offloader, stepper)
        offloader.copies.drain()
    sizes = [chunk.nbytes for chunk in offloader.chunks]
    assert max(sizes) > 3 * min(sizes)  # uneven: the ring packs the small ones
    # The last step's copies, in the order queued: the copies in of the small chunks the large one's buffer
    # takes over wait for its copy out, the first ones for nothing.
    last = len(streams.copies) - 2 * len(sizes)
    ins = [after for direction, after in streams.copies[last:] if direction == PREFETCH]
    outs = [last + i for i, (direction, _) in enumerate(streams.copies[last:]) if direction == OFFLOAD]
    assert len(ins) == len(outs) == len(sizes)  # every chunk streamed: in and out once, in step order
    assert buffers_for(sizes, 3) == 2  # one large chunk among small ones: two buffers
    expected = [None if p.reuses is None else outs[p.reuses] for p in places(sizes, max(sizes), 2)]
    assert [None if after is None else after.index for after in ins] == expected
    assert expected[:2] == [None] * 2 and any(expected)
    assert streamed_step.footprint(offloader) >= 3 * max(sizes)  # the bound the last backward counts on
    offloader.wait()
    assert_same_training_state(reference, optimizer)


@pytest.mark.parametrize("skipped", [None, 2])
def test_copies_in_started_as_the_step_begins_serve_its_update(skipped: int | None) -> None:
    """``begin_staging`` as megatron-core's step begins starts the first buffers' copies in; the update uses
    them, each chunk coming in once. An update megatron-core skips (``skipped``: that step's) leaves the state
    as it was: what came in leaves again with the rest."""
    reference, optimizer, offloader, streams = uneven_pair()
    stepper = ChunkStepper(optimizer)
    for step in range(5):
        set_grads(optimizer, step)
        before = len(streams.copies)
        staging = streamed_step.begin_staging(offloader)
        early = [direction for direction, _ in streams.copies[before:]]
        assert early and set(early) == {PREFETCH}
        if step == skipped:
            offloader.offload(now=False)  # as the step's wrapper does, however the step ended
            offloader.copies.drain()
            continue
        set_grads(reference, step)
        reference.step()
        with offloader.device_view.params_on_device():
            streamed_step.run(offloader, stepper, staging=staging)
        offloader.copies.drain()
        ins = [direction for direction, _ in streams.copies[before:] if direction == PREFETCH]
        assert len(ins) == len(offloader.chunks)  # none came in twice
    offloader.wait()
    assert_same_training_state(reference, optimizer)


class Outs(HostStreams):
    """Copies at once, as HostStreams, recording the bytes of each copy out in the order queued."""

    def __init__(self) -> None:
        self.outs: list[int] = []

    def copy(self, direction, pairs, after):
        if direction == OFFLOAD:
            self.outs.append(sum(destination.nbytes for destination, _ in pairs))
        return super().copy(direction, pairs, after)


def test_the_largest_streamed_chunk_goes_first_so_that_the_step_ends_on_small_copies() -> None:
    """megatron-core reads a scalar right after the step, behind every device-to-host copy queued before it: the
    streamed chunks are updated largest first, those of one size in step order, bit for bit."""
    torch.manual_seed(0)
    reference, _ = adam_with_masters((*[150] * 40, 2000))
    torch.manual_seed(0)
    optimizer, masters = adam_with_masters((*[150] * 40, 2000))
    streams = Outs()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, streams=streams)
    offloader.offload()
    offloader.copies.drain()
    stepper = ChunkStepper(optimizer)
    for step in range(3):
        set_grads(reference, step)
        reference.step()
        set_grads(optimizer, step)
        streams.outs.clear()
        with offloader.device_view.params_on_device():
            streamed_step.run(offloader, stepper)
        offloader.copies.drain()
    sizes = [chunk.nbytes for chunk in offloader.chunks]
    assert sizes[-1] == max(sizes) > 3 * min(sizes)  # the large one last in step order
    assert streams.outs == sorted(sizes, reverse=True)  # out in the order updated: the large one first
    offloader.wait()
    assert_same_training_state(reference, optimizer)
