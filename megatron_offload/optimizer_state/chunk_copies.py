"""A chunk's copies out and back, on the copy core (core/copies.py), and where its tensors point.

A copy out waits for the compute stream's last write to the chunk, a copy back for the compute work
that last used its memory. A chunk's tensors point at its GPU block until its copy out starts, then at
their host copy; at its block again once its copy back starts (the compute stream waits for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_offload.core.copies import Copy, CopyError, CopyQueue
from megatron_offload.core.stats import OffloadStats, Timings
from megatron_offload.core.streams import OFFLOAD, PREFETCH, Event, Streams
from megatron_offload.core.units import MIB
from megatron_offload.optimizer_state import plan as planning
from megatron_offload.optimizer_state.pieces import Memory, Pieces, bounds, split_runs
from megatron_offload.optimizer_state.plan import Chunk
from megatron_offload.optimizer_state.planned_state import PlannedState

__all__ = ["ChunkCopies", "ChunkCopy", "OffloadCopyError"]


class OffloadCopyError(CopyError):
    """A copy of optimizer state failed; the message names the chunk and the direction."""


@dataclass(eq=False, kw_only=True)
class ChunkCopy(Copy):
    """The copies of one chunk in one direction; ``held`` are the tensors of their own it reads (out)."""

    chunk: Chunk
    block: Memory | None  # the GPU memory it reads (offload) or fills (prefetch): held until it landed
    in_block: list[bool] = field(default_factory=list)  # out: per entry, read from the block (else ``held``)


class ChunkCopies:
    """The offloader's copies: queue a chunk out or back, and keep its tensors pointing at whole data.
    The one owner of the bytes leaving and of the step index the copy times are filed under."""

    def __init__(
        self, state: PlannedState, stats: OffloadStats, timings: Timings, streams: Streams, copies: CopyQueue
    ) -> None:
        self.state = state  # the plan and the host slab every chunk's host copy is a view of
        self.stats = stats  # the offloader's; this object adds the bytes it queues each way
        self.timings = timings
        self.streams = streams
        self.copies = copies
        self.step_index = 0
        self.leaving_bytes = 0  # GPU bytes of chunks queued or in flight out (freed when they land)

    def next_step(self) -> None:
        """File the copy times from here on under the next step."""
        self.step_index += 1

    def new_block(self, nbytes: int) -> torch.Tensor:
        """Device memory for state, from the compute stream's pool."""
        try:
            return self.streams.block(nbytes)
        except torch.OutOfMemoryError as error:
            raise torch.OutOfMemoryError(
                f"megatron-offload: not enough GPU memory to bring back {nbytes / MIB:.0f} MiB of optimizer "
                "state; the state is still whole in host memory. Use --offload-prefetch step (the step streams "
                f"the state through three chunks), lower --offload-chunk-mb, or reduce the micro-batch size. ({error})"
            ) from error

    def blocks_for(self, chunk: Chunk) -> Memory:
        """Device memory for a chunk coming back: blocks of at most ``--offload-chunk-mb`` (pieces.py)."""
        starts = bounds([(e.offset, planning.aligned(e.nbytes)) for e in chunk.entries], self.state.chunk_bytes)
        return self.new_block(chunk.nbytes) if len(starts) == 1 else Pieces.make(starts, chunk.nbytes, self.new_block)

    def _chunk_copy(self, chunk: Chunk, direction: str, pairs: list, **fields: object) -> ChunkCopy:
        label = chunk.label(len(self.state.chunks))
        hooks = {"on_start": self._started, "on_landed": self._landed, "on_failed": self._failed}
        copy = ChunkCopy(
            direction=direction, pairs=pairs, label=label, on_released=self._released, chunk=chunk, **hooks, **fields
        )
        chunk.copy = copy
        return copy

    def queue_offload(self, chunk: Chunk, now: bool = False) -> ChunkCopy | None:
        """Queue the chunk's copy to host after the compute stream's last write to it, and point its
        tensors at the host copy when the copy starts. ``now``: start it at once (its stream waits on the
        device for that write, already queued). An unchanged chunk is dropped, not copied."""
        if chunk.copy is not None and chunk.copy.direction == PREFETCH and chunk.copy.done is None:
            self.cancel(chunk.copy)  # a copy back that never started: the chunk is still on the host
        if not chunk.on_gpu or self.leaving(chunk):
            return None
        if not chunk.touched:
            # Its host copy is exact: nothing to copy. A copy still filling the block holds it till it lands.
            chunk.copy = None
            self._point_at_host(chunk)
            return None
        pairs, keep, slab = [], [], self.state.slab
        in_block = [chunk.block is not None and entry.in_block for entry in chunk.entries]
        stretches = planning.runs([e for e, b in zip(chunk.entries, in_block, strict=True) if b])
        for host, offset, size in split_runs(stretches, chunk.block):
            pairs.append((slab[host : host + size], chunk.block[offset : offset + size]))
        for entry, in_it in zip(chunk.entries, in_block, strict=True):
            if not in_it:  # storage of its own (made by the optimizer, or before the first offload)
                keep.append(entry.tensor.data)
                pairs.append((entry.host, entry.tensor.data))
        after = self.streams.mark()  # the compute stream's last write to the chunk
        copy = self._chunk_copy(
            chunk, OFFLOAD, pairs, after=after, held=keep, frees=chunk.nbytes, block=chunk.block, in_block=in_block
        )
        self.leaving_bytes += chunk.nbytes
        self.stats.bytes_offloaded += chunk.nbytes
        return self.copies.put(copy, now=now)

    def queue_prefetch(
        self, chunk: Chunk, block: Memory | None = None, after: Event | None = None, now: bool = False
    ) -> ChunkCopy:
        """Queue the chunk's copy back into ``block`` (default: new blocks, ``blocks_for``; ``after`` then
        defaults to the compute stream's current end, as that memory may have been used by work still queued);
        ``now``: start it at once (its stream waits on the device for ``after``, already queued)."""
        if block is None:
            block = self.blocks_for(chunk)
            after = after or self.streams.mark()
        slab = self.state.slab
        pairs = [
            (block[offset : offset + size], slab[host : host + size])
            for host, offset, size in split_runs(planning.runs(chunk.entries), block)
        ]
        copy = self._chunk_copy(chunk, PREFETCH, pairs, after=after, block=block)
        self.stats.bytes_prefetched += chunk.nbytes
        return self.copies.put(copy, now=now)

    def cancel(self, copy: ChunkCopy) -> None:
        """Forget a copy that has not started: a chunk going out stays on the GPU, one coming back stays
        on the host (its new block, unwritten, goes back to the allocator)."""
        self.copies.cancel(copy)
        if copy.direction == OFFLOAD:
            self.leaving_bytes -= copy.chunk.nbytes
        copy.chunk.copy = None

    def holding_bytes(self) -> int:
        """State holding GPU memory now: chunks on the GPU, and chunks whose copy either way holds a block."""
        return sum(chunk.nbytes for chunk in self.state.chunks if chunk.on_gpu or chunk.copy is not None)

    def kept_to_come_back(self) -> int:
        """Kept state neither on the GPU nor coming back (newly kept, or still leaving)."""
        away = [not c.on_gpu and (c.copy is None or c.copy.direction != PREFETCH) for c in self.state.chunks]
        return sum(max(c.nbytes, c.expected) for c, out in zip(self.state.chunks, away, strict=True) if c.kept and out)

    @staticmethod
    def leaving(chunk: Chunk) -> bool:
        return chunk.copy is not None and chunk.copy.direction == OFFLOAD

    def _started(self, copy: ChunkCopy) -> None:
        if self.streams.timed:
            self.timings.add(copy.direction, self.step_index, copy.began, copy.done)
        chunk = copy.chunk
        if copy.direction == OFFLOAD:
            self._point_at_host(chunk)
        else:
            for entry in chunk.entries:
                entry.tensor.data = planning.view(copy.block, entry.offset, entry.tensor)
            chunk.on_gpu, chunk.block, chunk.ready = True, copy.block, copy.done

    def _landed(self, copy: ChunkCopy) -> None:
        """The copy has landed: the chunk no longer waits for it; the queue drops the memory it held."""
        chunk = copy.chunk
        if chunk.copy is copy:
            chunk.copy = None
            if copy.direction == OFFLOAD:
                self.leaving_bytes -= chunk.nbytes
            elif chunk.ready is copy.done:
                chunk.ready = None  # landed: the compute stream need not wait for it
        copy.block = None  # the block's last reference from here: freed now, nothing reads it any more

    def _released(self, copy: ChunkCopy) -> None:
        """The compute stream waits for the copy out on the device (``CopyQueue.release``): its block goes
        back now, and to the compute stream the chunk is on the host (a copy back queued behind a later
        compute-stream mark reads whole data)."""
        chunk = copy.chunk
        if chunk.copy is copy:
            chunk.copy = None
            self.leaving_bytes -= chunk.nbytes
        copy.block = None  # the block's last reference: the allocator hands it out behind that wait only

    def _failed(self, copy: ChunkCopy, error: BaseException) -> None:
        """Point the chunk at a whole copy of its data (the GPU memory a failed copy out read; the host
        copy a failed copy back was filling from) and raise, naming the chunk and direction. A copy out
        whose GPU memory was already given back leaves no whole copy: the error says so."""
        chunk = copy.chunk
        if copy.direction == OFFLOAD and copy.released:
            raise OffloadCopyError(
                f"megatron-offload: copy of optimizer state failed: {copy.describe(error)}; its GPU memory was "
                "already given back, so this chunk's host copy may be incomplete: stop and resume from the last "
                "complete checkpoint."
            ) from error
        if copy.direction == OFFLOAD:
            self._point_at_sources(copy)
            chunk.touched = True
            self.leaving_bytes -= chunk.nbytes
        else:
            self._point_at_host(chunk)
        chunk.copy = None
        raise OffloadCopyError(
            f"megatron-offload: copy of optimizer state failed: {copy.describe(error)}; nothing was lost on this "
            "chunk; stop and resume from the last complete checkpoint."
        ) from error

    def _point_at_host(self, chunk: Chunk) -> None:
        for entry in chunk.entries:
            entry.tensor.data = entry.host  # the GPU memory is now held only by the copy reading it
            entry.in_block = True  # the next copy back puts it in the chunk's block
        chunk.on_gpu, chunk.block, chunk.ready, chunk.touched = False, None, None, False

    def _point_at_sources(self, copy: ChunkCopy) -> None:
        """Point a chunk going out at the GPU memory its copy reads: its block, and tensors of their own."""
        chunk, own = copy.chunk, iter(copy.held)  # held: the tensors of their own, in entry order
        for entry, in_block in zip(chunk.entries, copy.in_block, strict=True):
            entry.tensor.data = planning.view(copy.block, entry.offset, entry.tensor) if in_block else next(own)
            entry.in_block = in_block
        chunk.on_gpu, chunk.block = True, copy.block

    def revive(self, chunk: Chunk) -> None:
        """A chunk whose copy out is in flight comes back without a copy: the memory it is read from still
        holds it. The compute stream must let that copy finish reading before it writes there."""
        copy = chunk.copy
        self._point_at_sources(copy)
        chunk.ready, chunk.copy = copy.done, None
        copy.frees = 0  # the chunk uses that memory again: its landing frees nothing
        self.leaving_bytes -= chunk.nbytes

    def hand_to_compute(self, chunk: Chunk) -> None:
        """Make the chunk usable by the compute stream: start its copy back if still queued, and order
        the compute stream after it on the device (timed: the copy time the step stood waiting)."""
        copy = chunk.copy
        if copy is not None and copy.direction == PREFETCH and copy.done is None:
            self.copies.start(copy)
        elif copy is not None and copy.direction == OFFLOAD:
            if copy.done is None:
                self.cancel(copy)  # never started: the chunk is still here
            else:
                self.revive(chunk)
        if chunk.ready is not None:
            if chunk.ready.query():
                chunk.ready = None  # landed already: no wait on the device at all
            else:
                # On the device: the compute stream waits for the copy; the host goes on queueing the step.
                start, end = self.streams.compute_waits(chunk.ready)
                if self.streams.timed:
                    self.timings.add("exposed", self.step_index, start, end)
                chunk.ready = None
        chunk.touched = True
