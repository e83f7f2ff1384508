"""The copies' schedule without a GPU: events that complete only when the test says so.

What it proves: a copy whose dependency has not completed is left for the next point (``pump()``
never waits); at most ``IN_FLIGHT`` copies run per direction; GPU memory a copy reads is held until
that copy has landed; a copy that fails is raised at the next point, naming the chunk and direction,
with the chunk pointing at a whole copy of its data; a chunk whose copy out has not started simply
stays when it is wanted back; a released copy out gives its block back before it lands, and the chunk
comes back by a copy ordered after it.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from megatron_offload import OffloadCopyError, OptimizerStateOffloader
from megatron_offload.core.copies import IN_FLIGHT
from megatron_offload.core.streams import HostStreams
from tests.gates import Gate


class ManualStreams(HostStreams):
    """Copies happen at once (host memory), but their events and the compute marks complete by hand."""

    def __init__(self) -> None:
        self.marks: list[Gate] = []
        self.started: list[tuple[str, Gate]] = []

    def mark(self) -> Gate:
        self.marks.append(Gate())
        return self.marks[-1]

    def copy(self, direction, pairs, after):
        super().copy(direction, pairs, after)
        self.started.append((direction, Gate()))
        return None, self.started[-1][1]

    def open_all(self) -> None:
        for gate in self.marks + [gate for _, gate in self.started]:
            gate.open = True


class DeviceWaitStreams(ManualStreams):
    """As ManualStreams, with the compute stream's waits recorded, not made (a device wait: the host goes on)."""

    def __init__(self) -> None:
        super().__init__()
        self.compute_waited: list[Gate] = []

    def compute_waits(self, event):
        self.compute_waited.append(event)
        return None, None


def offloader_with(streams: ManualStreams, count: int = 6) -> tuple[OptimizerStateOffloader, list[torch.Tensor]]:
    masters = [torch.nn.Parameter(torch.randn(300)) for _ in range(count)]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    for master in masters:
        master.grad = torch.randn(300)
    optimizer.step()
    offloader = OptimizerStateOffloader(
        optimizer, masters, chunk_bytes=3000, pin_memory=False, check_host_memory=False, streams=streams
    )
    return offloader, masters


def offloaded_once(streams: ManualStreams) -> tuple[OptimizerStateOffloader, list[torch.Tensor]]:
    """An offloader whose state went out once and landed, every copy gate open."""
    offloader, masters = offloader_with(streams)
    offloader.offload()
    streams.open_all()
    offloader.copies.drain()
    offloader.wait()
    streams.open_all()
    return offloader, masters


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


def test_a_chunk_wanted_back_before_its_copy_out_started_simply_stays() -> None:
    streams = ManualStreams()
    offloader, _ = offloader_with(streams)
    offloader.offload(now=False)  # queued; the compute stream has not finished writing yet
    assert offloader.leaving_bytes == offloader.stats.host_bytes
    assert offloader.prefetch() == 0  # nothing to copy back: it never left
    assert offloader.leaving_bytes == 0 and offloader.copies.idle
    assert all(chunk.on_gpu for chunk in offloader.chunks)


def test_a_chunk_wanted_back_while_its_copy_out_runs_comes_back_without_a_copy() -> None:
    streams = ManualStreams()
    offloader, _ = offloader_with(streams)
    offloader.offload(now=False)
    for gate in streams.marks:
        gate.open = True
    offloader.copies.pump()
    first = offloader.chunks[0]
    out = first.copy
    assert not first.on_gpu and out is not None
    offloader.hand_to_compute(first)  # the step needs it: its block still holds it
    assert first.on_gpu and first.copy is None
    assert [d for d, _ in streams.started].count("prefetch") == 0  # no copy back


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


def leaving_in_three_stages(streams: ManualStreams) -> OptimizerStateOffloader:
    """Chunks 0-1 out and landed, 2-3 still on their way out, the rest queued out, not started."""
    offloader, _ = offloaded_once(streams)
    for chunk in offloader.chunks:
        offloader.hand_to_compute(chunk)
    streams.open_all()
    offloader.copies.pump()
    offloader.offload(now=False)
    for gate in streams.marks:
        gate.open = True
    offloader.copies.pump()  # chunks 0 and 1 start out
    for _, gate in streams.started[-IN_FLIGHT:]:
        gate.open = True
    offloader.copies.pump()  # 0 and 1 land, 2 and 3 start
    assert len(offloader.chunks) > 2 * IN_FLIGHT
    return offloader


def test_the_backwards_calls_bring_back_every_landed_chunk_once_wherever_the_last_call_stopped() -> None:
    streams = ManualStreams()
    offloader = leaving_in_three_stages(streams)
    chunks = offloader.chunks
    size = chunks[0].nbytes
    assert offloader.prefetch(max_bytes=size, landed_only=True) == size  # room for one: chunk 0 only
    assert offloader.prefetch(landed_only=True) == chunks[1].nbytes  # 2 and 3 still leaving; the rest never left
    assert [c.copy is not None and c.copy.direction == "prefetch" for c in chunks[:4]] == [True, True, False, False]
    assert all(c.on_gpu and c.copy is None for c in chunks[4:])  # their copies out were dropped: they stay
    for _, gate in streams.started:
        gate.open = True
    offloader.copies.pump()  # 2 and 3 land
    assert offloader.prefetch(landed_only=True) == chunks[2].nbytes + chunks[3].nbytes
    assert all(c.copy is not None and c.copy.direction == "prefetch" for c in chunks[:4])  # 0 and 1 not twice
    for _ in range(3):  # the marks the copies back wait for complete, then the copies land, two at a time
        streams.open_all()
        offloader.copies.pump()
    assert all(chunk.on_gpu for chunk in chunks) and offloader.copies.idle


def test_chunks_whose_copy_back_the_step_dropped_come_back_at_the_next_call() -> None:
    streams = ManualStreams()
    offloader, masters = offloaded_once(streams)
    values = [master.detach().clone() for master in masters]
    offloader.offload()
    streams.open_all()
    offloader.copies.drain()
    assert offloader.prefetch() == offloader.stats.host_bytes  # queued back; the compute stream's mark is running
    offloader.offload(now=False)  # the step's end: the copies back that never started are dropped
    assert offloader.copies.idle and not any(chunk.on_gpu for chunk in offloader.chunks)
    assert offloader.prefetch() == offloader.stats.host_bytes  # every one of them, from the first
    streams.open_all()
    offloader.wait()
    assert all(torch.equal(m.detach(), v) for m, v in zip(masters, values, strict=True))
