"""The copies' schedule without a GPU: events that complete only when the test says so.

What it proves: a copy whose dependency has not completed is left for the next point (``pump()``
never waits); at most ``IN_FLIGHT`` copies run per direction; GPU memory a copy reads is held until
that copy has landed; a copy that fails is raised at the next point, naming the chunk and direction,
with the chunk pointing at a whole copy of its data; a released copy out gives its block back before it
lands, and the chunk comes back by a copy ordered after it; a released copy out that fails says the host
copy may be incomplete. Chunks wanted back while they leave are test_copies_back.py's.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from megatron_offload import OffloadCopyError
from megatron_offload.core.copies import IN_FLIGHT
from tests.gates import Gate
from tests.optimizer_state.manual_streams import ManualStreams, offloaded_once, offloader_with


class DeviceWaitStreams(ManualStreams):
    """As ManualStreams, with the compute stream's waits recorded, not made (a device wait: the host goes on)."""

    def __init__(self) -> None:
        super().__init__()
        self.compute_waited: list[Gate] = []

    def compute_waits(self, event):
        self.compute_waited.append(event)
        return None, None


def test_a_copy_whose_dependency_is_running_is_left_for_the_next_point() -> None:
    streams = ManualStreams()
    offloader, _ = offloader_with(streams)
    offloader.offload(now=False)
    offloader.copies.pump()
    assert streams.started == []  # the compute stream's last write has not completed: nothing starts
    assert all(chunk.on_gpu for chunk in offloader.chunks)  # still whole where it was
    for gate in streams.marks:
        gate.open = True
    offloader.copies.pump()
    assert [direction for direction, _ in streams.started] == ["offload"] * IN_FLIGHT


def test_at_most_in_flight_copies_per_direction_and_memory_held_until_landed() -> None:
    streams = ManualStreams()
    offloader, _ = offloader_with(streams)
    offloader.offload()  # every chunk onto the host, landed
    streams.open_all()
    offloader.copies.drain()
    offloader.prefetch()  # back into new blocks, a few at a time
    streams.open_all()
    offloader.copies.pump()
    assert len(offloader.chunks) > IN_FLIGHT + 1
    for chunk in offloader.chunks:  # the step hands them to compute; now they leave
        offloader.hand_to_compute(chunk)
    blocks = [weakref.ref(chunk.block) for chunk in offloader.chunks]
    offloader.offload(now=False)
    for gate in streams.marks:
        gate.open = True
    started = len(streams.started)
    offloader.copies.pump()
    assert len(streams.started) - started == IN_FLIGHT  # bounded, although every dependency is done
    first = offloader.chunks[0]
    assert not first.on_gpu and blocks[0]() is not None  # pointing at the host; its block held by the copy
    offloader.copies.pump()
    assert len(streams.started) - started == IN_FLIGHT  # none landed yet: nothing more starts
    for _, gate in streams.started[started:]:
        gate.open = True
    offloader.copies.pump()
    assert blocks[0]() is None  # landed: its GPU memory is given back
    assert len(streams.started) - started == 2 * IN_FLIGHT


def test_a_failed_copy_is_named_at_the_next_point_and_the_chunk_keeps_whole_data() -> None:
    streams = ManualStreams()
    offloader, masters = offloaded_once(streams)
    values = [master.detach().clone() for master in masters]
    offloader.offload(now=False)
    for gate in streams.marks:
        gate.open = True
    offloader.copies.pump()
    streams.started[-IN_FLIGHT][1].error = "injected: copy failed"
    with pytest.raises(OffloadCopyError, match=r"chunk 1 of \d+ .*GPU to host.*injected: copy failed"):
        offloader.copies.pump()
    failed = offloader.chunks[0]
    assert failed.on_gpu  # pointing at the GPU memory its copy read, which holds the values
    for master, value in zip(masters, values, strict=True):
        if any(master is param for param in failed.params):
            assert torch.equal(master.detach(), value)


def test_a_released_copy_out_gives_its_block_back_before_it_lands_and_comes_back_by_a_copy() -> None:
    streams = DeviceWaitStreams()
    offloader, masters = offloaded_once(streams)
    for chunk in offloader.chunks:
        offloader.hand_to_compute(chunk)
    streams.open_all()
    offloader.copies.pump()  # the copies back have landed: the blocks are the chunks' alone
    streams.compute_waited.clear()
    values = [master.detach().clone() for master in masters]
    first = offloader.chunks[0]
    block = weakref.ref(first.block)
    offloader.offload(now=False)  # the step's end: every chunk queued out
    assert offloader.copies.release(first.nbytes) == first.nbytes
    out = streams.started[-1][1]
    assert streams.compute_waited == [out] and not out.open  # the compute stream waits, the host does not
    assert block() is None and first.copy is None  # its block is back with the allocator, behind that wait
    assert offloader.leaving_bytes == offloader.stats.host_bytes - first.nbytes and not offloader.copies.idle
    marks = len(streams.marks)
    offloader.prefetch()  # wanted back before its copy out landed: a copy back, not its old block
    back = first.copy
    assert back is not None and back.direction == "prefetch" and back.after is streams.marks[marks]
    streams.open_all()
    offloader.copies.drain()
    offloader.wait()
    assert all(torch.equal(m.detach(), v) for m, v in zip(masters, values, strict=True))


def test_a_released_copy_out_that_fails_says_the_host_copy_may_be_incomplete() -> None:
    streams = DeviceWaitStreams()
    offloader, _ = offloader_with(streams)
    offloader.offload(now=False)
    offloader.copies.release()
    streams.started[0][1].error = "injected: copy failed"
    with pytest.raises(OffloadCopyError, match=r"chunk 1 of \d+ .*GPU to host.*host copy may be incomplete"):
        offloader.copies.pump()
