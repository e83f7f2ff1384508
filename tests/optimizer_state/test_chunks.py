"""Chunks and the streamed step on CPU tensors: the streamed step bitwise equal to the plain one,
chunks that hold whole parameters near their size, the fraction kept on the device and changed between
steps, eviction of kept chunks, and a chunk that came back for a skipped step dropped, not copied again.
"""

from __future__ import annotations

import pytest
import torch

from tests.optimizer_state.cpu_engine import (
    aligned,
    assert_same_training_state,
    in_host_slab,
    many_masters,
    offloader_for,
    run_step,
    set_grads,
    take_step,
)


@pytest.mark.parametrize("prefetch_bytes", [None, 0, 6000])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_streamed_step_matches_the_plain_step_bit_for_bit(prefetch_bytes: int | None, fraction: float) -> None:
    reference, _ = many_masters()
    offloaded, masters = many_masters()
    offloader = offloader_for(offloaded, masters, chunk_bytes=2000, fraction=fraction)
    offloader.offload()
    for step in range(5):
        set_grads(reference, step)
        reference.step()
        set_grads(offloaded, step)
        offloader.prefetch(max_bytes=prefetch_bytes)
        with offloader.device_view.params_on_device():
            run_step(offloader)
        assert offloader.is_offloaded
        assert all((not chunk.on_gpu) is not chunk.kept for chunk in offloader.chunks)  # kept ones stay
    assert len(offloader.chunks) > (3 if fraction == 1.0 else 1)
    if prefetch_bytes == 0:
        assert offloader.stats.bytes_streamed >= 4 * offloader.stats.offloaded_bytes  # steps 2-5 streamed it all
    offloader.wait()
    assert_same_training_state(reference, offloaded)


def test_chunks_hold_whole_parameters_and_respect_the_size() -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    owner_of = {id(p): p for p in masters} | {id(v): p for p in masters for v in optimizer.state[p].values()}
    owners = {}
    for index, chunk in enumerate(offloader.chunks):
        largest_param = max(aligned(p.numel() * 4) for p in chunk.params)
        assert chunk.nbytes < 2000 + 3 * largest_param  # closes at the first param boundary past the size
        for entry in chunk.entries:
            owners.setdefault(id(owner_of[id(entry.tensor)]), set()).add(index)
    assert all(len(chunks) == 1 for chunks in owners.values())  # a param's master and moments share a chunk


def test_fraction_keeps_the_rest_on_the_device() -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, fraction=0.5)
    offloader.offload()
    total = offloader.stats.host_bytes  # every byte is planned, so that kept state can leave at once
    assert 0.3 * total < offloader.stats.offloaded_bytes < 0.7 * total
    assert offloader.stats.kept_bytes == total - offloader.stats.offloaded_bytes
    kept = [p for chunk in offloader.chunks if chunk.kept for p in chunk.params]
    assert kept and all(not in_host_slab(offloader, p) for p in kept)
    none = offloader_for(*many_masters(), fraction=0.0)
    none.offload()
    assert none.stats.offloaded_bytes == 0 and not none.is_offloaded


def test_a_new_fraction_moves_whole_chunks_and_keeps_values() -> None:
    reference, _ = many_masters()
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    for step, fraction in enumerate([1.0, 0.25, 0.25, 0.75, 0.0, 1.0]):
        offloader.set_fraction(fraction)
        set_grads(reference, step)
        reference.step()
        set_grads(optimizer, step)
        with offloader.device_view.params_on_device():
            run_step(offloader)
        kept = [chunk for chunk in offloader.chunks if chunk.kept]
        assert all(chunk.on_gpu for chunk in kept)  # newly kept chunks came back through the step
        assert all((not chunk.on_gpu) for chunk in offloader.chunks if not chunk.kept)
        share = offloader.stats.offloaded_bytes / offloader.stats.host_bytes
        assert abs(share - fraction) < 0.25, (fraction, share)
        assert offloader.kept_bytes == offloader.plan.kept_bytes()  # the hooks read this count, kept current
    offloader.wait()
    assert_same_training_state(reference, optimizer)


def test_eviction_offloads_kept_chunks_with_their_values() -> None:
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, fraction=0.0)
    take_step(optimizer, 0)
    offloader.offload()
    before = {id(p): (p.clone(), optimizer.state[p]["exp_avg"].clone()) for p in masters}
    assert offloader.stats.kept_bytes == offloader.stats.host_bytes and not offloader.is_offloaded
    started = offloader.evict(1)
    assert 0 < started < offloader.stats.host_bytes  # the first kept chunk, not all of them
    offloader.copies.drain()
    evicted = [chunk for chunk in offloader.chunks if (not chunk.on_gpu)]
    assert len(evicted) == 1 and not evicted[0].kept
    assert offloader.stats.kept_bytes == offloader.stats.host_bytes - evicted[0].nbytes
    assert offloader.kept_bytes == offloader.plan.kept_bytes()
    offloader.wait()
    for p in masters:
        assert torch.equal(p, before[id(p)][0]) and torch.equal(optimizer.state[p]["exp_avg"], before[id(p)][1])


def test_a_chunk_that_came_back_unused_is_dropped_not_copied() -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    copied = offloader.stats.bytes_offloaded
    offloader.prefetch()  # brought back during backward, then the step is skipped (inf/nan grads)
    offloader.offload()
    assert offloader.stats.bytes_offloaded == copied and offloader.is_offloaded
