"""A chunk coming back asks the allocator for blocks of at most ``--offload-chunk-mb``, not one block as large as
the chunk: where pieces start, that no stretch of a copy spans two, and that state brought back into pieces and
stepped there is bitwise the state of the optimizer that never offloaded."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.optimizer_state.pieces import Pieces, bounds, split_runs
from megatron_offload.optimizer_state.plan import ALIGN, aligned
from tests.optimizer_state.cpu_engine import (
    adam_with_masters,
    assert_same_training_state,
    offloader_for,
    run_step,
    set_grads,
    take_step,
)


@pytest.mark.parametrize("most", [1, 100, 256, 1000, 10**9])
def test_pieces_start_where_entries_do_and_pass_the_limit_only_for_one_entry(most: int) -> None:
    sizes = [256, 512, 768, 256, 2048, 256, 256]
    spans, offset = [], 0
    for size in sizes:
        spans.append((offset, size))
        offset += size
    starts = bounds(list(reversed(spans)), most)  # in any order
    assert starts[0] == 0 and starts == sorted(set(starts))
    assert set(starts) <= {start for start, _ in spans}  # no entry spans two pieces
    for start, end in zip(starts, [*starts[1:], offset], strict=True):
        inside = [size for begin, size in spans if start <= begin < end]
        assert sum(inside) <= most or len(inside) == 1  # within the limit, or one entry larger than it
        following = [size for begin, size in spans if begin == end]
        assert not following or sum(inside) + following[0] > most  # as few pieces as the limit allows


def test_a_copy_over_pieces_is_cut_where_they_meet_and_lands_every_byte() -> None:
    sizes = [256, 512, 768, 256, 2048]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    starts = bounds(list(zip(offsets, sizes, strict=True)), 1024)
    assert len(starts) > 2
    pieces = Pieces.make(starts, total, lambda n: torch.zeros(n, dtype=torch.uint8))
    assert pieces.nbytes == total
    host = torch.randint(0, 255, (total + 1000,), dtype=torch.uint8)
    stretches = split_runs([(1000, 0, total)], pieces)  # one stretch on the host, as the slab lays a chunk out
    assert len(stretches) == len(starts)
    for at, offset, size in stretches:
        pieces[offset : offset + size].copy_(host[at : at + size])
    assert torch.equal(torch.cat(pieces.blocks), host[1000:])
    with pytest.raises(IndexError, match="span two pieces"):
        pieces[starts[1] - ALIGN : starts[1] + ALIGN]
    assert split_runs([(0, 0, total)], torch.zeros(total, dtype=torch.uint8)) == [(0, 0, total)]  # one block


def test_state_brought_back_into_pieces_trains_bitwise_like_the_optimizer_without_offloading() -> None:
    sizes = (4000, 37, 1000, 5, 3000, 2500)
    torch.manual_seed(0)
    reference, reference_masters = adam_with_masters(sizes)
    torch.manual_seed(0)
    optimizer, masters = adam_with_masters(sizes)
    offloader = offloader_for(optimizer, masters, chunk_bytes=4 * 4000)
    seen = []
    for step in range(6):
        take_step(reference, step)
        if step % 2:  # the whole step: the state back into pieces first
            offloader.wait()
            seen += [c.block for c in offloader.chunks]
            take_step(optimizer, step)
        else:  # the streamed step: what is not back streams through its staging buffers
            set_grads(optimizer, step)
            offloader.prefetch(max_bytes=offloader.stats.host_bytes // 2)
            seen += [c.block for c in offloader.chunks]
            run_step(offloader)
        offloader.offload()
    pieced = [block for block in seen if isinstance(block, Pieces)]
    assert pieced and all(len(block.blocks) > 1 for block in pieced)
    offloader.wait()
    back = [chunk for chunk in offloader.chunks if isinstance(chunk.block, Pieces)]
    assert back
    for chunk in back:  # every piece starts with an entry; a piece passes the limit only for one entry
        assert set(chunk.block.starts) <= {entry.offset for entry in chunk.entries}
        for start, piece in zip(chunk.block.starts, chunk.block.blocks, strict=True):
            inside = [e for e in chunk.entries if start <= e.offset < start + piece.numel()]
            assert piece.numel() <= offloader.chunk_bytes or len(inside) == 1
        assert sum(aligned(entry.nbytes) for entry in chunk.entries) == chunk.block.nbytes
    assert_same_training_state(reference, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(reference_masters, masters, strict=True))
