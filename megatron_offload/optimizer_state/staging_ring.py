"""Where the streamed step puts each streamed chunk in its staging buffers, and whose memory it takes over.

The buffers are as large as the largest streamed chunk, so an even cut would leave most of them empty where
one parameter's state (an embedding's) makes a chunk many times the others': the copy in of the chunk after
next would then wait for that large chunk's copy out, the link's way in idle meanwhile. Here the chunks
follow one another through the buffers as through a ring: each after the one before in the same buffer while
it fits, else at the start of the next buffer, round robin. A chunk's copy in waits, on the device, for the
copy out of the latest earlier chunk whose bytes it takes over (copies out land in order: the earlier ones have
landed then); small chunks fill a buffer, so the copies in run up to two buffers ahead of the update.
Three buffers (one coming in, one updated, one going out) where the chunks are of one size; two where the
largest is at least twice the third largest (``buffers_for``): from the third on, each buffer holds two chunks or
more, so a chunk's copy in still runs while the one before it is updated, and the third buffer, mostly empty
behind one large chunk, is not taken: under a tight cap, a GiB less at the step for a 1 GiB embedding's state
(the step's footprint still counts three: ``streamed_step.footprint`` says why).
``Staging`` holds one step's buffers and starts those copies in as the chunks before them leave; it may be
made as the optimizer's step begins, before megatron-core's work ahead of the update (``begin_staging``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_offload.core.streams import Event
from megatron_offload.optimizer_state.plan import ALIGN, Chunk, Plan, aligned

if TYPE_CHECKING:
    from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader

__all__ = ["Place", "Staging", "buffers_for", "places"]


@dataclass(frozen=True)
class Place:
    """A chunk's bytes in the staging buffers: ``buffer[offset : offset + size]``."""

    buffer: int
    offset: int
    size: int
    # The latest earlier chunk whose bytes it overlaps (whose copy out must have read them); None: none.
    reuses: int | None


def buffers_for(sizes: Sequence[int], most: int) -> int:
    """How many staging buffers chunks of ``sizes`` (in any order) stream through (see above): at most ``most``,
    two where the largest holds two of the third largest, aligned; never more than there are chunks."""
    ordered = sorted(sizes, reverse=True)
    if len(ordered) > 2 and 2 * aligned(ordered[2]) <= ordered[0]:
        return min(2, most)
    return min(most, len(ordered))


def places(sizes: Sequence[int], capacity: int, buffers: int) -> list[Place]:
    """Each chunk's place, in update order, in ``buffers`` buffers of ``capacity`` bytes each (at least the
    largest size). Every place starts ``ALIGN``-aligned. A chunk never reuses the bytes of either of the two
    chunks before it where there are three buffers, nor that of the one before it where there are two: an empty
    buffer holds any chunk, a chunk that stays in a buffer starts past the one before it, and the buffer a chunk
    moves on to held only chunks older than those of the buffers used since."""
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


class Staging:
    """One step's streamed chunks (those neither on the GPU nor coming back), in update order, through at most
    ``most`` staging buffers (``buffers_for``) as large as the largest of them; the owner of those buffers and of
    the copies in started so far."""

    def __init__(self, off: OptimizerStateOffloader, streamed: list[Chunk], most: int) -> None:
        self.off = off
        self.plan: Plan = off.plan
        self.streamed = streamed
        self.size = max((chunk.nbytes for chunk in streamed), default=0)
        sizes = [chunk.nbytes for chunk in streamed]
        self.buffers = [off.new_block(self.size) for _ in range(buffers_for(sizes, most))]
        self.fresh = off.streams.mark()  # the buffers' memory may have been used by compute work still queued
        self.places = places(sizes, self.size, len(self.buffers))
        self.leaving: list[Event] = []  # per chunk updated: its copy out's end (or a mark after its update)
        self.brought = 0  # chunks whose copy in is queued
        off.stats.bytes_streamed += sum(chunk.nbytes for chunk in streamed)

    def left(self, done: Event | None) -> None:
        """The next chunk has been updated and queued out (``done``: its copy out's end; None: it needed none),
        then start what may come in now."""
        # Without a copy out, its bytes are free once the update queued on the compute stream has run.
        self.leaving.append(done if done is not None else self.off.streams.mark())
        self.bring_in_due()

    def queued_behind_first(self) -> int:
        """Bytes of the streamed chunks after the first whose copies in are queued (they land after it)."""
        return sum(chunk.nbytes for chunk in self.streamed[1 : self.brought])

    def bring_in_due(self) -> None:
        """Queue, in order, the copies in of the chunks whose bytes no chunk still to leave holds."""
        while self.brought < len(self.streamed):
            chunk, at = self.streamed[self.brought], self.places[self.brought]
            if at.reuses is not None and at.reuses >= len(self.leaving):
                return  # its bytes are an earlier chunk's, not queued out yet: after that chunk's update
            # On the device: the bytes may be written once the copy out that reads them has landed (queued
            # already; or the update that last used them has run); fresh buffers once the compute stream's
            # work queued before they were taken is done.
            after = self.fresh if at.reuses is None else self.leaving[at.reuses]
            buffer = self.buffers[at.buffer][at.offset : at.offset + at.size]
            self.off.copies.start(self.off.queue_prefetch(chunk, buffer, after=after))
            self.brought += 1
