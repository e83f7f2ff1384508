"""Where a chunk's tensors sit in its GPU memory: the stretches its copies move, the pieces that memory comes in,
and pointing the tensors there.

Hot: a chunk's copy back is queued and started dozens of times an iteration, often from the backward's hooks,
whose host time the GPU waits for where the training loop is host-bound. A chunk's stretches and pieces are
worked out once (its entries are only ever appended, each at offsets fixed when it joins), and its tensors are
pointed into the block with one ``as_strided`` each on a typed view of their piece, instead of a slice and two
views per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from megatron_offload.optimizer_state.pieces import Memory, Pieces, bounds

__all__ = ["bound_starts", "point_at", "runs", "whole_runs"]


class Placed(Protocol):
    """What these functions read of a plan.Entry."""

    tensor: torch.Tensor
    host_offset: int
    offset: int
    nbytes: int


class Laid(Protocol):
    """What these functions read and cache on a plan.Chunk."""

    entries: list
    layout: dict


def runs(entries: Iterable[Placed], align: int) -> list[tuple[int, int, int]]:
    """(host offset, block offset, bytes) of each stretch that is contiguous on both sides: one copy each.
    A chunk has one, or two after Adam's first step added its moments at the end of the slab. Each entry
    takes its size rounded up to ``align``."""
    found: list[list[int]] = []
    for entry in sorted(entries, key=lambda e: e.offset):
        size = -(-entry.nbytes // align) * align
        if found and found[-1][0] + found[-1][2] == entry.host_offset and found[-1][1] + found[-1][2] == entry.offset:
            found[-1][2] += size
        else:
            found.append([entry.host_offset, entry.offset, size])
    return [(host, block, size) for host, block, size in found]


def whole_runs(chunk: Laid, align: int) -> list[tuple[int, int, int]]:
    """``runs`` of all the chunk's entries, worked out once per set of entries."""
    key = ("runs", len(chunk.entries), align)
    if key not in chunk.layout:
        chunk.layout[key] = runs(chunk.entries, align)
    return chunk.layout[key]


def bound_starts(chunk: Laid, align: int, most: int) -> list[int]:
    """Where the chunk's pieces of at most ``most`` bytes start (pieces.bounds), worked out once per set of entries."""
    key = ("bounds", len(chunk.entries), align, most)
    if key not in chunk.layout:
        spans = [(e.offset, -(-e.nbytes // align) * align) for e in chunk.entries]
        chunk.layout[key] = bounds(spans, most)
    return chunk.layout[key]


def point_at(entries: Iterable[Placed], block: Memory) -> None:
    """Point each entry's tensor at its bytes in ``block`` from its offset: the tensor's shape and dtype, contiguous,
    the same memory as a uint8 slice of the block viewed as that dtype and shape."""
    typed: dict[tuple[int, torch.dtype], torch.Tensor | None] = {}
    for entry in entries:
        tensor = entry.tensor
        piece, start = block.locate(entry.offset, entry.nbytes) if isinstance(block, Pieces) else (block, entry.offset)
        dtype, shape = tensor.dtype, tensor.shape
        key = (id(piece), dtype)
        if key not in typed:
            typed[key] = _typed(piece, dtype)
        base, size = typed[key], dtype.itemsize
        if base is None or start % size or start + entry.nbytes > piece.numel():
            tensor.data = piece[start : start + entry.nbytes].view(dtype).view(shape)  # plan.view's way; raises if not
        else:  # a tensor pointed at the host slab or a block is contiguous already: its strides are the ones
            strides = tensor.stride() if tensor.is_contiguous() else _contiguous(shape)
            tensor.data = base.as_strided(shape, strides, base.storage_offset() + start // size)


def _typed(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The uint8 ``piece`` as ``dtype`` (its whole elements), or None where its start is not aligned to one."""
    size = dtype.itemsize
    if piece.storage_offset() % size:
        return None
    return piece[: piece.numel() - piece.numel() % size].view(dtype)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))
