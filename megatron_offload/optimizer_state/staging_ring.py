"""Where the streamed step puts each streamed chunk in its staging buffers, and whose memory it takes over.

The buffers are as large as the largest streamed chunk, so an even cut would leave most of them empty where
one parameter's state (an embedding's) makes a chunk many times the others': the copy in of the chunk after
next would then wait for that large chunk's copy out, the link's way in idle meanwhile. Here the chunks
follow one another through the buffers as through a ring: each after the one before in the same buffer while
it fits, else at the start of the next buffer, round robin. A chunk's copy in waits, on the device, for the
copy out of the last earlier chunk whose bytes it takes over (copies out land in order: the earlier ones have
landed then); small chunks fill a buffer, so the copies in run up to two buffers ahead of the update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_offload.optimizer_state.plan import ALIGN

__all__ = ["Place", "places"]


@dataclass(frozen=True)
class Place:
    """A chunk's bytes in the staging buffers: ``buffer[offset : offset + size]``."""

    buffer: int
    offset: int
    size: int
    reuses: (
        int | None
    )  # the latest earlier chunk whose bytes it overlaps (its copy out must have read them); None: none


def places(sizes: Sequence[int], capacity: int, buffers: int) -> list[Place]:
    """Each chunk's place, in update order, in ``buffers`` buffers of ``capacity`` bytes each (at least the
    largest size). Every place starts ``ALIGN``-aligned. A chunk never reuses the bytes of either of the two
    chunks before it where there are three buffers: an empty buffer holds any chunk, and the buffer a chunk moves
    on to held only chunks older than those of the two buffers used since."""
    if sizes and max(sizes) > capacity:
        raise ValueError(f"staging buffers of {capacity} bytes cannot hold a chunk of {max(sizes)} bytes")
    held: list[list[tuple[int, int, int]]] = [[] for _ in range(buffers)]  # (start, end, index): who last wrote where
    found: list[Place] = []
    buffer, offset = 0, 0
    for index, size in enumerate(sizes):
        start = -(-offset // ALIGN) * ALIGN
        if start + size > capacity:
            buffer, start = (buffer + 1) % buffers, 0
        end = start + size
        overlapped = [other for s, e, other in held[buffer] if s < end and start < e]
        # What an earlier chunk still holds of this buffer: its bytes outside this chunk's.
        kept = [(s, e, other) for s, e, other in held[buffer] if e <= start or end <= s]
        kept += [(s, start, other) for s, e, other in held[buffer] if s < start < e]
        kept += [(end, e, other) for s, e, other in held[buffer] if s < end < e]
        held[buffer] = [*kept, (start, end, index)]
        found.append(Place(buffer, start, size, max(overlapped, default=None)))
        offset = end
    return found
