"""The walk behind the offloader's ``prefetch``: queue offloaded chunks back, in step order, within a budget.

It goes on from the plan's ``back_until`` (the backward's hooks call it dozens of times) and moves that past
every chunk that is back or coming back. What each chunk needs is the copies' (chunk_copies.py): a copy out
not started yet is dropped, one still reading its block is revived, the rest come back into new blocks
(``ChunkCopies.blocks_for``).
"""

from __future__ import annotations

from megatron_offload.core.streams import PREFETCH, Streams
from megatron_offload.optimizer_state.chunk_copies import ChunkCopies
from megatron_offload.optimizer_state.plan import Plan

__all__ = ["queue_back"]


def queue_back(
    plan: Plan, mover: ChunkCopies, streams: Streams, max_bytes: int | None, landed_only: bool, now: bool = False
) -> int:
    """Queue the plan's offloaded chunks back up to ``max_bytes`` (None: all); with ``landed_only``, only those
    whose copy out has landed. Returns the bytes queued (the offloader's pump starts their copies; ``now``: each
    starts as it is queued)."""
    started, mark = 0, None
    settled = True  # every chunk so far is back or coming back
    for index in range(plan.back_until, len(plan.chunks)):
        chunk = plan.chunks[index]
        copy = chunk.copy
        if copy is not None and copy.direction == PREFETCH:
            pass  # on its way back already
        elif copy is not None and copy.done is None:
            mover.cancel(copy)  # its copy out has not started: the chunk never left
        elif chunk.on_gpu:
            pass
        elif landed_only and copy is not None:
            settled = False  # still leaving: a later call comes back for it
            continue
        elif copy is not None:
            mover.revive(chunk)  # costs no memory and no copy
        elif max_bytes is not None and started + chunk.nbytes > max_bytes:
            break
        else:
            mark = mark or streams.mark()  # one mark for every block allocated here
            mover.queue_prefetch(chunk, mover.blocks_for(chunk), after=mark, now=now)
            started += chunk.nbytes
        if settled:
            plan.back_until = index + 1
    return started
