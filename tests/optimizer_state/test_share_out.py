"""The ready chunks' copies out within the streamed step (``share_out.ShareOut``), on the CPU.

What it proves: chunks that came back before the step start their copies out inside it, between the
streamed chunks' copies out rather than all ahead of them, but for as many as still come in ahead of the first
streamed chunk's update, which go ahead of its copy out; all but the bytes left to the forward (the last
ones), which stay queued for the loop's next points; with nothing streamed, all of them at once; the values
are those of the optimizer's own step either way.
"""

from __future__ import annotations

import pytest

from megatron_offload.core.streams import OFFLOAD, PREFETCH, HostStreams
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from tests.gates import Gate
from tests.optimizer_state.cpu_engine import assert_same_training_state, many_masters, offloader_for, set_grads


class Recording(HostStreams):
    """Copies at once, as HostStreams; each copy out's first host byte, in the order they started. While
    ``hold``, the compute stream's marks never complete: the loop's points (``pump``) start no copy queued
    behind one, so what a step left queued stays so (a start within the step waits on the device)."""

    def __init__(self) -> None:
        self.out: list[int] = []
        self.hold = False

    def mark(self, timed: bool = False):
        return Gate() if self.hold else super().mark(timed)

    def copy(self, direction, pairs, after):
        if direction == OFFLOAD:
            self.out.append(pairs[0][0].data_ptr())
        return super().copy(direction, pairs, after)


class InFlight(Recording):
    """Recording, whose copies in are still in flight at the step: each lands when the compute stream
    first waits for it (the chunk's update), so the step sees them coming in."""

    def copy(self, direction, pairs, after):
        began, done = super().copy(direction, pairs, after)
        return (began, Gate()) if direction == PREFETCH else (began, done)


def step_with_some_back(back_bytes: int | None, forward_hides: int, in_flight=False):
    """Five steps as the loop runs them: bring back ``back_bytes`` (None: all), then the streamed step
    leaving ``forward_hides`` bytes; the last step's copies out are left as the step leaves them.
    ``in_flight``: the copies in are still coming in as the step begins."""
    reference, _ = many_masters()
    optimizer, masters = many_masters()
    streams = InFlight() if in_flight else Recording()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, streams=streams)
    offloader.offload()
    stepper = ChunkStepper(optimizer)
    for step in range(5):
        offloader.copies.drain()  # the loop's points between steps landed every copy out
        set_grads(reference, step)
        reference.step()
        set_grads(optimizer, step)
        offloader.prefetch(max_bytes=back_bytes)
        back = [chunk for chunk in offloader.chunks if chunk.on_gpu or chunk.copy is not None]
        streams.out.clear()
        streams.hold = True
        with offloader.device_view.params_on_device():
            streamed_step.run(offloader, stepper, forward_hides=forward_hides)
        streams.hold = False
    return reference, optimizer, offloader, back, streams


def first_byte(chunk) -> int:
    return min(entry.host.data_ptr() for entry in chunk.entries)


def test_ready_chunks_leave_between_the_streamed_ones_within_the_step() -> None:
    reference, optimizer, offloader, back, streams = step_with_some_back(20000, forward_hides=0)
    assert back and len(back) < len(offloader.chunks)  # some came back, some streamed
    assert offloader.copies.queued(OFFLOAD) == []  # every copy out started within the step
    order = [next(c.index for c in offloader.chunks if first_byte(c) == ptr) for ptr in streams.out]
    ready = {chunk.index for chunk in back}
    streamed = [index for index in order if index not in ready]
    assert sorted(order) == sorted(c.index for c in offloader.chunks)  # each chunk left once
    assert order.index(streamed[0]) < max(order.index(index) for index in ready)  # not all ready ones first
    offloader.copies.drain()
    offloader.wait()
    assert_same_training_state(reference, optimizer)


def test_as_many_leave_ahead_of_the_first_streamed_chunk_as_come_in_before_its_update() -> None:
    """The way out carries about what the way in carries meanwhile: while the chunks brought back still come
    in ahead of the first streamed chunk's update, their copies out are queued ahead of that chunk's copy out
    (behind it, they would wait for its update with the way out idle); landed ones are spread as before."""
    landed = step_with_some_back(20000, forward_hides=0)
    reference, optimizer, offloader, back, streams = step_with_some_back(20000, forward_hides=0, in_flight=True)
    for run, spread in ((landed, True), ((reference, optimizer, offloader, back, streams), False)):
        chunks, ready = run[2].chunks, {chunk.index for chunk in run[3]}
        assert ready and len(ready) < len(chunks)  # some came back, some streamed
        order = [next(c.index for c in chunks if first_byte(c) == ptr) for ptr in run[4].out]
        assert sorted(order) == sorted(c.index for c in chunks)  # each chunk left once, within the step
        first_streamed = next(i for i, index in enumerate(order) if index not in ready)
        assert (set(order[:first_streamed]) != ready) == spread
    offloader.copies.drain()
    offloader.wait()
    assert_same_training_state(reference, optimizer)


@pytest.mark.parametrize("left_chunks", [1, 100])
def test_the_bytes_left_to_the_forward_stay_queued_the_last_ready_chunks(left_chunks: int) -> None:
    reference, optimizer, offloader, back, streams = step_with_some_back(20000, forward_hides=0)
    sizes = [chunk.nbytes for chunk in back]
    left = sum(sizes[-left_chunks:])
    reference, optimizer, offloader, back, streams = step_with_some_back(20000, forward_hides=left)
    queued = [copy.chunk for copy in offloader.copies.queued(OFFLOAD)]
    assert queued == back[len(back) - min(left_chunks, len(back)) :]  # the last ones, oldest first
    assert sum(chunk.nbytes for chunk in queued) <= left
    offloader.copies.drain()
    offloader.wait()
    assert_same_training_state(reference, optimizer)


def test_with_nothing_streamed_every_ready_chunk_leaves_within_the_step() -> None:
    reference, optimizer, offloader, back, streams = step_with_some_back(None, forward_hides=0)
    assert len(back) == len(offloader.chunks) and offloader.stats.bytes_streamed == 0
    assert offloader.copies.queued(OFFLOAD) == [] and len(streams.out) == len(back)
    offloader.copies.drain()
    offloader.wait()
    assert_same_training_state(reference, optimizer)
