"""A chunk's stretches and pieces are worked out once per set of entries, and its tensors pointed into its memory
with one ``as_strided`` each: the same memory, shape, dtype and contiguity as a uint8 slice viewed as each tensor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_offload.optimizer_state.layout import bound_starts, point_at, runs, whole_runs
from megatron_offload.optimizer_state.pieces import Pieces, bounds
from megatron_offload.optimizer_state.plan import ALIGN, aligned, view
from tests.optimizer_state.cpu_engine import entries, many_masters, offloader_for, take_step

SHAPES = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((), torch.float32), ((2, 0, 4), torch.float32),
          ((4, 1, 3), torch.int64), ((33,), torch.uint8), ((6, 6), torch.float16)]  # fmt: skip


def placed(shapes: list) -> tuple[list[SimpleNamespace], int]:
    """Entries at aligned offsets of one chunk, their tensors on the host (contiguous, as before a copy back)."""
    found, offset = [], 0
    for shape, dtype in shapes:
        tensor = torch.zeros(shape, dtype=dtype)
        nbytes = tensor.numel() * tensor.element_size()
        found.append(SimpleNamespace(tensor=tensor, offset=offset, host_offset=offset, nbytes=nbytes))
        offset += aligned(nbytes)
    return found, offset


def uint8(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype, a.untyped_storage().data_ptr()) == (
        b.data_ptr(), b.shape, b.stride(), b.dtype, b.untyped_storage().data_ptr()
    )  # fmt: skip


@pytest.mark.parametrize("most", [ALIGN, 3 * ALIGN, 10**9])
def test_point_at_gives_what_a_slice_viewed_as_the_tensor_gives(most: int) -> None:
    found, total = placed(SHAPES)
    starts = bounds([(e.offset, aligned(e.nbytes)) for e in found], most)
    block = uint8(total) if len(starts) == 1 else Pieces.make(starts, total, uint8)
    expected = [view(block, e.offset, e.tensor) for e in found]
    point_at(found, block)
    for entry, want in zip(found, expected, strict=True):
        assert same_memory(entry.tensor, want) and entry.tensor.is_contiguous()


def test_point_at_a_block_inside_a_larger_buffer_and_one_off_a_word_fails_as_a_view_would() -> None:
    found, total = placed(SHAPES)
    buffer = uint8(total + 2 * ALIGN)
    block = buffer[ALIGN : ALIGN + total]  # a staging slot of a larger buffer
    expected = [view(block, e.offset, e.tensor) for e in found]
    point_at(found, block)
    assert all(same_memory(e.tensor, want) for e, want in zip(found, expected, strict=True))
    with pytest.raises(RuntimeError, match="divisible"):  # no 4-byte word starts there: no float32 tensor either
        point_at(found[:1], buffer[1 : 1 + total])


def test_the_offloaders_tensors_read_what_was_written_through_their_block() -> None:
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2048)
    take_step(optimizer, 0)
    for entry in entries(offloader):
        entry.tensor.data = entry.host.clone()  # host copies, as after a copy out
    for chunk in offloader.chunks:
        block = offloader.mover.blocks_for(chunk)
        for host, offset, size in runs(chunk.entries, ALIGN):
            block[offset : offset + size].copy_(offloader.state.slab[host : host + size])
        wanted = [entry.tensor.clone() for entry in chunk.entries]
        point_at(chunk.entries, block)
        assert all(torch.equal(e.tensor, w) for e, w in zip(chunk.entries, wanted, strict=True))


def test_stretches_and_pieces_are_worked_out_again_once_entries_are_appended() -> None:
    found, _ = placed(SHAPES[:3])
    chunk = SimpleNamespace(entries=found[:2], layout={})
    first, starts = whole_runs(chunk, ALIGN), bound_starts(chunk, ALIGN, ALIGN)
    assert whole_runs(chunk, ALIGN) is first and bound_starts(chunk, ALIGN, ALIGN) is starts  # once per set
    chunk.entries.append(found[2])
    assert whole_runs(chunk, ALIGN) == runs(found, ALIGN) != first
    assert bound_starts(chunk, ALIGN, ALIGN) == bounds([(e.offset, aligned(e.nbytes)) for e in found], ALIGN)
