"""The ready chunks' copies out within the streamed step (streamed_step.py), beside the chunks streaming in.

Chunks that came back before the step (during the last backward, or kept) are updated first; their copies
out could wait for the next forward's hooks, but that forward must free their memory before its activations
grow, and under a tight cap it then runs at the link's pace. Started within the step, they share the link
with the copies in, each direction at about its own speed, and run beside the step's compute. What the step
cannot finish before its end is left to the forward: one copy engine serves the device-to-host copies in
order, so a read megatron-core makes right after the step (a loss ``.item()``) would wait behind them with
the whole device idle, where the forward's hooks wait on the device only and the host goes on queueing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from megatron_offload.core.copies import CopyQueue
from megatron_offload.core.streams import Event, Streams
from megatron_offload.optimizer_state.chunk_copies import ChunkCopy
from megatron_offload.optimizer_state.plan import Chunk

__all__ = ["ShareOut", "StepWindow"]


class StepWindow:
    """How long a step computes after its ready chunks' copies out may start (the first group's update is
    queued) until its end, on the device, and what the link carries out in that time. Timed at every step
    that has ready chunks leaving and read at the next one without a wait (its events have long completed
    then; one that has not is read a step later). ``link()``: bytes per second the copies out have reached
    (0 until timed). The owner is the optimizer's streamed step, one per offloader."""

    def __init__(self, streams: Streams, link: Callable[[], float]) -> None:
        self.streams = streams
        self.link = link
        self.ms: float | None = None  # the last window read
        self._opened: Event | None = None  # this step's window, while it runs
        self._timed: tuple[Event, Event] | None = None  # a closed window not read yet

    def open(self) -> None:
        """The step's first ready group has been queued: its copies out may start from here (on the device)."""
        if self._opened is None and self.streams.timed:
            # Timed, on the compute stream behind that update; read at the next step, never waited for.
            self._opened = self.streams.mark(timed=True)

    def close(self) -> None:
        """The step's work has been queued: the window ends where the compute stream is now."""
        if self._opened is not None:
            # Behind the step's last update on the compute stream; queried, never waited for (``carries``).
            self._timed = (self._opened, self.streams.mark(timed=True))
            self._opened = None

    def abandon(self) -> None:
        """The step failed: its window says nothing of the next."""
        self._opened = None

    def carries(self) -> int | None:
        """Bytes the link carries out in the last window read; None until a window and the link were timed."""
        if self._timed is not None and self._timed[1].query():
            self.ms = self._timed[0].elapsed_time(self._timed[1])
            self._timed = None
        link = self.link()
        if self.ms is None or link <= 0:
            return None
        return int(link * self.ms / 1000)


class ShareOut:
    """The ready chunks' copies out, started within the step so that the link's other direction carries
    them while state comes in (both at once), instead of the next forward, which must free that memory
    before its activations grow. All but ``left`` bytes (what the forward hides behind its compute; the
    last ones), and no more than the step's ``window`` carries beside the streamed chunks' own copies out.
    Ahead of the first streamed chunk's copy out, at least as many bytes as come in before its update (the
    way out carries about as much as the way in meanwhile; queued behind that copy out, they would wait for
    it with the way out idle), else in proportion to the bytes coming in meanwhile; the rest spread over the
    streamed chunks, so that each streamed chunk's copy out, which frees a staging buffer, waits behind a
    share only. What is left stays queued for the loop's next points."""

    def __init__(
        self, copies: CopyQueue, moving: int, coming: int, streamed: int, left: int, window: StepWindow | None = None
    ) -> None:
        self.copies = copies
        self.window = window
        self.waiting: deque[ChunkCopy] = deque()
        self.goal = max(0, moving - left)  # bytes of ready chunks to start within the step
        carries = window.carries() if window is not None else None
        if carries is not None:
            # The streamed chunks' copies out must leave within the step (their buffers are needed again).
            self.goal = min(self.goal, max(0, carries - streamed))
        self.coming = coming  # bytes coming in before the first streamed chunk's update
        self.streamed = streamed
        self.passed = self.started = 0

    def add(self, copy: ChunkCopy | None) -> None:
        """A ready chunk's copy out has been queued (None: it needed none), after its group's update."""
        if self.window is not None:
            self.window.open()
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
