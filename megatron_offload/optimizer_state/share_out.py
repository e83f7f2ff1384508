"""The ready chunks' copies out within the streamed step (streamed_step.py), beside the chunks streaming in.

Chunks that came back before the step (during the last backward, or kept) are updated first; their copies
out could wait for the next forward's hooks, but that forward must free their memory before its activations
grow, and under a tight cap it then runs at the link's pace. Started within the step, they share the link
with the copies in, each direction at about its own speed, and run beside the step's compute. The last bytes,
what the link carries out while the next forward computes, are left to that forward: one copy engine serves the
device-to-host copies in order, so a read megatron-core makes right after the step (a loss ``.item()``) would
wait behind them with the whole device idle, where the forward's hooks wait on the device only and the host
goes on queueing. The rest start within the step even where they outlast it: bounded by the step's own time,
they went to the forward beyond what it hides, and a step shortened by state back early then sent out less.
"""

from __future__ import annotations

from collections import deque

from megatron_offload.core.copies import CopyQueue
from megatron_offload.optimizer_state.chunk_copies import ChunkCopy
from megatron_offload.optimizer_state.plan import Chunk

__all__ = ["ShareOut"]


class ShareOut:
    """The ready chunks' copies out, started within the step so that the link's other direction carries
    them while state comes in (both at once), instead of the next forward, which must free that memory
    before its activations grow. All but ``left`` bytes (what the forward hides behind its compute; the
    last ones). Ahead of the first streamed chunk's copy out, at least as many bytes as come in before its
    update (the way out carries about as much as the way in meanwhile; queued behind that copy out, they would
    wait for it with the way out idle), else in proportion to the bytes coming in meanwhile; the rest spread
    over the streamed chunks, so that each streamed chunk's copy out, which frees a staging buffer, waits
    behind a share only. What is left stays queued for the loop's next points."""

    def __init__(self, copies: CopyQueue, moving: int, coming: int, streamed: int, left: int) -> None:
        self.copies = copies
        self.waiting: deque[ChunkCopy] = deque()
        self.goal = max(0, moving - left)  # bytes of ready chunks to start within the step
        self.coming = coming  # bytes coming in before the first streamed chunk's update
        self.streamed = streamed
        self.passed = self.started = 0

    def add(self, copy: ChunkCopy | None) -> None:
        """A ready chunk's copy out has been queued (None: it needed none), after its group's update."""
        if copy is not None:
            self.waiting.append(copy)
        self._start_due()

    def streamed_out(self, chunk: Chunk) -> None:
        """A streamed chunk's copy out has been queued."""
        self.passed += chunk.nbytes
        self._start_due()

    def _start_due(self) -> None:
        whole = self.coming + self.streamed
        due = self.goal if not whole else self.goal * (self.coming + self.passed) // whole
        if self.streamed:
            ahead = min(self.goal, self.coming)  # what the way out carries before the first streamed update
            due = max(due, ahead + (self.goal - ahead) * self.passed // self.streamed)
        while self.waiting and self.started + self.waiting[0].chunk.nbytes <= due:
            copy = self.waiting.popleft()
            if copy.done is None and copy.pairs:  # not started by a point meanwhile, nor dropped
                # Its stream waits on the device for the chunk's update (queued already); the host goes on.
                self.copies.start(copy)
            self.started += copy.chunk.nbytes
