"""Chunks wanted back while their copies out are queued, running or landed, without a GPU: events that
complete only when the test says so.

What it proves: a chunk whose copy out has not started simply stays when it is wanted back; one whose copy
out is running comes back without a copy; the backward's calls bring back every landed chunk once,
wherever the last call stopped; chunks whose copy back the step dropped come back at the next call.
"""

from __future__ import annotations

import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.core.copies import IN_FLIGHT
from tests.optimizer_state.manual_streams import ManualStreams, offloaded_once, offloader_with


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


def out_and_landed(streams: ManualStreams) -> tuple[OptimizerStateOffloader, list[torch.Tensor], list[torch.Tensor]]:
    """An offloader whose state went out a second time and landed, with the masters' values then."""
    offloader, masters = offloaded_once(streams)
    values = [master.detach().clone() for master in masters]
    offloader.offload()
    streams.open_all()
    offloader.copies.drain()
    return offloader, masters, values


def test_chunks_whose_copy_back_the_step_dropped_come_back_at_the_next_call() -> None:
    streams = ManualStreams()
    offloader, masters, values = out_and_landed(streams)
    assert offloader.prefetch() == offloader.stats.host_bytes  # queued back; the compute stream's mark is running
    offloader.offload(now=False)  # the step's end: the copies back that never started are dropped
    assert offloader.copies.idle and not any(chunk.on_gpu for chunk in offloader.chunks)
    assert offloader.prefetch() == offloader.stats.host_bytes  # every one of them, from the first
    streams.open_all()
    offloader.wait()
    assert all(torch.equal(m.detach(), v) for m, v in zip(masters, values, strict=True))


def test_copies_back_started_now_run_behind_the_compute_streams_work_in_step_order() -> None:
    """The bring-back as backward ends: every chunk's copy back starts as it is queued, its stream waiting on the
    device for the compute stream's work (whose mark has not completed yet), in the step's order; the pump alone
    starts none while that mark runs. The state that comes back is exact."""
    streams = ManualStreams()
    offloader, masters, values = out_and_landed(streams)
    before = len(streams.started)
    assert offloader.prefetch() == offloader.stats.host_bytes
    assert len(streams.started) == before  # the pump waits for the mark: nothing started on the host's side
    offloader.offload(now=False)  # dropped again, never started
    assert offloader.prefetch(now=True) == offloader.stats.host_bytes
    started = streams.started[before:]
    assert [d for d, _ in started] == ["prefetch"] * len(offloader.chunks)
    assert [chunk.copy.done for chunk in offloader.chunks] == [gate for _, gate in started]  # in step order
    assert not streams.marks[-1].open  # the compute stream's work still running
    streams.open_all()
    offloader.wait()
    assert all(torch.equal(m.detach(), v) for m, v in zip(masters, values, strict=True))
