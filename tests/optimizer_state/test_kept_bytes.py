"""What stays on the GPU, asked for in bytes (``keep_bytes``, the scheduler's unit) or as a fraction
(``set_fraction``, ``--offload-fraction F``, made bytes): whole chunks from the back that fit in what is left,
one too large passed over, never over what was asked; an eviction lowers it for good."""

from __future__ import annotations

import pytest
import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.optimizer_state.scheduler import kept_chunks

LAYOUTS = [  # (parameter sizes, chunk bytes)
    ((37, 1000, 5, 300, 64, 700, 1), 2000),
    ((37, 1000, 5), 1),  # a chunk per parameter
    ((500,) * 6, 3000),  # equal chunks: fractions land on their halves
    ((1, 2, 3, 4000, 5, 600, 7000, 8), 5000),
    ((64,) * 40, 1),
]
FRACTIONS = [i / 20 for i in range(21)] + [0.01, 1 / 3, 0.499, 0.501, 2 / 3, 0.99]


def offloader_of(sizes: tuple[int, ...], chunk_bytes: int, stepped: bool) -> OptimizerStateOffloader:
    """fp32 masters that are the optimizer's params; ``stepped``: Adam's moments exist already."""
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    if stepped:
        for master in masters:
            master.grad = torch.randn(master.shape)
        optimizer.step()
    return OptimizerStateOffloader(
        optimizer, masters, chunk_bytes=chunk_bytes, pin_memory=False, check_host_memory=False
    )


def kept_flags(offloader: OptimizerStateOffloader) -> list[bool]:
    return [chunk.kept for chunk in offloader.chunks]


@pytest.mark.parametrize("stepped", [False, True], ids=["before-adams-first-step", "after"])
@pytest.mark.parametrize(("sizes", "chunk_bytes"), LAYOUTS)
def test_keeping_bytes_never_keeps_more_than_asked(sizes, chunk_bytes: int, stepped: bool) -> None:
    offloader = offloader_of(sizes, chunk_bytes, stepped)
    offloader.offload()
    total = offloader.plan.full_bytes()
    smallest = min(offloader.full_sizes())
    assert len(offloader.chunks) > 1
    for fraction in FRACTIONS:
        asked = int((1 - fraction) * total)
        kept = offloader.keep_bytes(asked)
        flags = kept_flags(offloader)
        assert kept == offloader.kept_bytes == offloader.plan.kept_bytes()
        assert kept <= asked  # rounded down: never over what was decided
        # From the back, every chunk passed over was larger than what was left of the bytes asked.
        left, full = asked, offloader.full_sizes()
        for index in reversed(range(len(flags))):
            assert flags[index] == (full[index] <= left), (fraction, index)
            left -= full[index] if flags[index] else 0
        assert kept == asked - left
        offloader.set_fraction(fraction)  # a fraction is the same bytes
        assert kept_flags(offloader) == flags, fraction
        # A plan made later (a checkpoint load) keeps by the same bytes.
        later = offloader_of(sizes, chunk_bytes, stepped)
        later.keep_bytes(asked)
        later.offload()
        assert kept_flags(later) == flags, fraction
    assert offloader.keep_bytes(smallest - 1) == 0


def test_kept_chunks_pass_over_a_large_chunk_at_the_back() -> None:
    sizes = [1024, 2048, 512]
    assert kept_chunks(sizes, 0) == set()
    assert kept_chunks(sizes, 511) == set()  # not even the smallest chunk fits
    assert kept_chunks(sizes, 512) == {2}
    assert kept_chunks(sizes, 512 + 2047) == {0, 2}  # the 2048 passed over, the 1024 before it fits
    assert kept_chunks(sizes, 512 + 2048) == {1, 2}
    assert kept_chunks(sizes, 3583) == {1, 2}
    assert kept_chunks(sizes, 3584) == {0, 1, 2}
    assert kept_chunks(sizes, 10**9) == {0, 1, 2}
    # The output layer's 1 GiB at the back of a room under 1 GiB: the layers' chunks before it stay instead.
    layers = [200] * 12 + [1100]
    assert kept_chunks(layers, 950) == {8, 9, 10, 11}
    for kept in range(0, 3584 + 1, 64):
        chosen = kept_chunks(sizes, kept)
        assert sum(sizes[i] for i in chosen) <= kept
        assert kept_chunks(sizes, sum(sizes[i] for i in chosen)) == chosen  # its own total: the same chunks


def test_eviction_is_not_undone_by_a_fraction_or_a_later_plan() -> None:
    offloader = offloader_of((500,) * 9, 3000, stepped=True)
    offloader.offload()
    offloader.keep_bytes(offloader.plan.full_bytes())
    offloader.wait()
    before = offloader.kept_bytes
    offloader.evict(1)  # memory ran short: the front of the kept run leaves
    after = offloader.kept_bytes
    assert 0 < after < before and offloader.state.kept_goal == after
    flags = kept_flags(offloader)
    assert flags == sorted(flags)
    offloader.state.replaced()  # a load: a new plan, the same goal
    offloader.plan.key = ("replaced",)
    offloader.offload()
    assert offloader.chunks and all(chunk.entries for chunk in offloader.chunks)
    assert offloader.kept_bytes == after


def test_an_eviction_past_a_passed_over_chunk_keeps_the_same_chunks_in_a_later_plan() -> None:
    """A large chunk at the back (an output layer's state) is passed over; an eviction lets the frontmost kept
    chunks go, and a new plan (a checkpoint load) keeps exactly those that stayed, the large one still not."""
    offloader = offloader_of((500,) * 8 + (4000,), 1, stepped=True)  # a chunk per parameter
    offloader.offload()
    full = offloader.full_sizes()
    kept = offloader.keep_bytes(4 * full[0] + full[0] // 2)  # room for four small chunks, not the large one
    assert kept == 4 * full[0] and kept_flags(offloader) == [False] * 4 + [True] * 4 + [False]
    offloader.wait()
    offloader.evict(1)  # the frontmost kept chunk leaves, for good
    flags = kept_flags(offloader)
    assert flags == [False] * 5 + [True] * 3 + [False] and offloader.kept_bytes == 3 * full[0]
    offloader.state.replaced()
    offloader.plan.key = ("replaced",)
    offloader.offload()
    assert kept_flags(offloader) == flags and offloader.kept_bytes == 3 * full[0]


def test_the_state_on_the_gpu_counts_kept_chunks_and_copies_that_hold_a_block() -> None:
    """``gpu_state_bytes``: what the backward's hooks take out of a reading to learn the step's own needs."""
    offloader = offloader_of((37, 1000, 5, 300, 64, 700, 1), 2000, stepped=True)
    offloader.keep_bytes(offloader.estimated_host_bytes() // 2)
    offloader.offload(now=False)  # planned and queued, not started: every chunk still holds its memory
    everything = sum(chunk.nbytes for chunk in offloader.chunks)
    kept = sum(chunk.nbytes for chunk in offloader.chunks if chunk.kept)
    assert 0 < kept < everything == offloader.gpu_state_bytes
    offloader.copies.drain()
    assert offloader.gpu_state_bytes == kept  # the rest is in host memory only
    offloader.prefetch(max_bytes=max(c.nbytes for c in offloader.chunks if not c.kept))  # a block comes back
    assert offloader.gpu_state_bytes > kept
    offloader.wait()
    assert offloader.gpu_state_bytes == everything


def test_newly_kept_state_counts_as_to_come_back_until_it_holds_memory_again() -> None:
    """Kept after the state went to host memory, chunks hold no device memory until the step brings them
    back: what the early copies must leave room for."""
    offloader = offloader_of((37, 1000, 5, 300, 64, 700, 1), 2000, stepped=True)
    assert offloader.kept_to_come_back == 0  # nothing kept yet
    offloader.offload()
    kept = offloader.keep_bytes(offloader.plan.full_bytes() // 2)
    assert kept > 0 and offloader.kept_to_come_back == kept
    offloader.wait()  # everything back where the step runs
    assert offloader.kept_to_come_back == 0
