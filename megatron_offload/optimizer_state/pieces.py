"""A chunk's GPU memory in a few blocks instead of one: what a chunk coming back asks the allocator for.

Near the memory limit a chunk comes back into memory that backward has just freed. One block as large as the
chunk (hundreds of MiB; a GiB for an embedding's state) often finds no free range that large among the
activations' freed blocks; the caching allocator then synchronizes the device, unmaps every free page and maps
them again, in the middle of the backward. Blocks of at most ``--offload-chunk-mb`` (an entry larger than that
gets one of its own) fit the ranges activations leave, and the allocator's best fit keeps the large free ranges
for backward's own large temporaries. A chunk's copy stays one copy: one stretch per piece at least.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Memory", "Pieces", "bounds", "split_runs"]


def bounds(spans: Sequence[tuple[int, int]], most: int) -> list[int]:
    """Where each piece starts, given the entries' (offset, bytes) in their chunk: entries in offset order, a
    new piece wherever the current one would pass ``most`` bytes. Pieces start where entries do, so no entry
    spans two; the first starts at 0 and the last runs to the chunk's end."""
    starts = [0]
    for offset, size in sorted(spans):
        if offset > starts[-1] and offset + size - starts[-1] > most:
            starts.append(offset)
    return starts


@dataclass(eq=False)
class Pieces:
    """Blocks that together stand for one block of ``nbytes``: piece i holds bytes ``[starts[i],
    starts[i + 1])``. Sliced like a uint8 block; a slice lies within one piece."""

    blocks: list[torch.Tensor]
    starts: list[int]

    @classmethod
    def make(cls, starts: list[int], nbytes: int, allocate: Callable[[int], torch.Tensor]) -> Pieces:
        ends = [*starts[1:], nbytes]
        return cls([allocate(end - start) for start, end in zip(starts, ends, strict=True)], list(starts))

    @property
    def nbytes(self) -> int:
        return self.starts[-1] + self.blocks[-1].numel()

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop = index.start or 0, index.stop
        piece = bisect.bisect_right(self.starts, start) - 1
        base = self.starts[piece]
        if stop - base > self.blocks[piece].numel():
            raise IndexError(f"bytes {start}-{stop} span two pieces (piece {piece} starts at {base})")
        return self.blocks[piece][start - base : stop - base]


Memory = torch.Tensor | Pieces  # a chunk's device memory: one uint8 block, or pieces


def split_runs(runs: list[tuple[int, int, int]], block: Memory | None) -> list[tuple[int, int, int]]:
    """(host offset, block offset, bytes) stretches cut where ``block``'s pieces meet (one block, or none:
    as they are), so that each lies within one piece."""
    if not isinstance(block, Pieces):
        return runs
    cut = []
    for host, offset, size in runs:
        edges = [start for start in block.starts if offset < start < offset + size]
        for begin, end in zip([offset, *edges], [*edges, offset + size], strict=True):
            cut.append((host + begin - offset, begin, end - begin))
    return cut
