"""The ready chunks' copies out within the streamed step (``share_out.ShareOut``), on the CPU.

What it proves: chunks that came back before the step start their copies out inside it, between the
streamed chunks' copies out rather than all ahead of them, but for as many as still come in ahead of the first
streamed chunk's update, which go ahead of its copy out; all but the bytes left to the forward (the last
ones), which stay queued for the loop's next points; with nothing streamed, all of them at once; no more than
the link carries in the step's time as the last step measured it (``StepWindow``), the rest queued; the values
are those of the optimizer's own step either way.
"""

from __future__ import annotations

import pytest

from megatron_offload.core.streams import OFFLOAD, PREFETCH, HostStreams
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from megatron_offload.optimizer_state.share_out import StepWindow
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


class At:
    """A timed event at ``at`` ms, completed unless ``pending``."""

    def __init__(self, at: float, pending: bool = False) -> None:
        self.at, self.pending = at, pending

    def query(self) -> bool:
        return not self.pending

    def synchronize(self) -> None:
        self.pending = False

    def elapsed_time(self, end: At) -> float:
        return end.at - self.at


class Clocked(Recording):
    """Recording, with timed marks: each one WINDOW_MS later than the one before."""

    timed = True
    WINDOW_MS = 10.0

    def __init__(self) -> None:
        super().__init__()
        self.timed_marks: list[At] = []

    def mark(self, timed: bool = False):
        if not timed:
            return super().mark(timed)
        self.timed_marks.append(At(len(self.timed_marks) * self.WINDOW_MS))
        return self.timed_marks[-1]


def step_with_some_back(back_bytes: int | None, forward_hides: int, carried: int | None = None, in_flight=False):
    """Five steps as the loop runs them: bring back ``back_bytes`` (None: all), then the streamed step
    leaving ``forward_hides`` bytes; the last step's copies out are left as the step leaves them. ``carried``:
    with a step window whose link carries that many bytes out in the time it measures. ``in_flight``: the
    copies in are still coming in as the step begins."""
    reference, _ = many_masters()
    optimizer, masters = many_masters()
    streams = InFlight() if in_flight else Recording() if carried is None else Clocked()
    window = None if carried is None else StepWindow(streams, lambda: carried / Clocked.WINDOW_MS * 1000)
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
            streamed_step.run(offloader, stepper, forward_hides=forward_hides, window=window)
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


@pytest.mark.parametrize("carried_chunks", [0, 2])
def test_no_more_leaves_within_the_step_than_its_window_carries(carried_chunks: int) -> None:
    """Each step times its window; the next starts within it the ready chunks' copies out the link carries
    in that time, oldest first: the rest stay queued for the loop's next points, the last ones."""
    reference, optimizer, offloader, back, streams = step_with_some_back(None, forward_hides=0)
    carried = max(1, sum(chunk.nbytes for chunk in back[:carried_chunks]))  # 1 byte: room for no chunk
    reference, optimizer, offloader, back, streams = step_with_some_back(None, 0, carried=carried)
    queued = [copy.chunk for copy in offloader.copies.queued(OFFLOAD)]
    assert len(streams.out) == carried_chunks  # those started within the step
    assert queued == back[carried_chunks:]
    assert len(streams.timed_marks) == 2 * 5  # a window opened and closed at every step
    offloader.copies.drain()
    offloader.wait()
    assert_same_training_state(reference, optimizer)


def test_a_window_carries_what_the_link_moves_in_its_last_timed_span() -> None:
    streams, link = Clocked(), [0.0]
    window = StepWindow(streams, lambda: link[0])
    assert window.carries() is None  # nothing timed
    window.open()
    window.open()  # the first group opened it: later ones leave it
    window.close()
    assert window.carries() is None  # the link is not timed yet
    link[0] = 2e9  # bytes per second
    assert window.carries() == int(2e9 * Clocked.WINDOW_MS / 1000)
    window.open()
    streams.timed_marks[-1].at += 5.0  # a shorter window, closed; its end still running on the device
    window.close()
    streams.timed_marks[-1].pending = True
    assert window.carries() == int(2e9 * Clocked.WINDOW_MS / 1000)  # the last one read, no wait
    streams.timed_marks[-1].pending = False
    assert window.carries() == int(2e9 * (Clocked.WINDOW_MS - 5.0) / 1000)
    window.open()
    window.abandon()  # a failed step's window is not read
    window.close()
    assert window.carries() == int(2e9 * (Clocked.WINDOW_MS - 5.0) / 1000)
    assert StepWindow(Recording(), lambda: 2e9).carries() is None  # untimed streams: never bounds


def test_the_window_bounds_the_ready_chunks_beside_the_streamed_ones_copies_out() -> None:
    """With chunks streaming, their own copies out leave within the step first: the ready chunks share what
    the window carries beyond them (none here)."""
    reference, optimizer, offloader, back, streams = step_with_some_back(20000, forward_hides=0)
    streamed = sum(chunk.nbytes for chunk in offloader.chunks if chunk not in back)
    reference, optimizer, offloader, back, streams = step_with_some_back(20000, 0, carried=streamed)
    queued = [copy.chunk for copy in offloader.copies.queued(OFFLOAD)]
    assert queued == back  # every ready chunk left to the loop's next points
    offloader.copies.drain()
    offloader.wait()
    assert_same_training_state(reference, optimizer)
