"""Copies queued behind the event they depend on, started at the caller's points, retired when landed.

Knows no optimizer and no Megatron. No thread of its own: copies start in ``pump()``, ``flush()``,
``start()``, ``release()`` or ``drain()``, called at points the caller passes anyway. ``pump()`` never
waits on the host, and runs at most ``in_flight`` copies per direction, so a read queued behind them (a
loss ``.item()``) waits for a few copies at most. A copy holds the memory it reads or fills until it has
landed, or until ``release()`` orders the compute stream after it; a failed copy is raised at the next
point, naming what it copied and which way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_offload.core.streams import OFFLOAD, PREFETCH, Event, Streams

__all__ = ["IN_FLIGHT", "WAYS", "Copy", "CopyError", "CopyQueue"]

# Copies started per direction and not yet landed: a read queued behind them (a loss .item()) waits
# for two chunks of 64 MiB at most (2.6 ms at 52 GB/s); two, so the link stays busy between points.
IN_FLIGHT = 2
WAYS = {OFFLOAD: "GPU to host", PREFETCH: "host to GPU"}


class CopyError(RuntimeError):
    """A copy failed; the message names what was copied and which way."""


@dataclass(eq=False)
class Copy:
    """Copies in one direction, from queued to landed. ``on_start`` runs once it has started (``began``
    and ``done`` set), ``on_landed`` once it has landed (before the memory it held is dropped);
    ``on_failed(copy, error)`` once it failed (taken off the queue), and may raise an error of its own."""

    direction: str
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source)
    after: Event | None = None  # must have completed before the copy may start
    held: list[torch.Tensor] = field(default_factory=list)  # memory it reads or fills: held until it landed
    label: str = "tensors"  # what it copies, for error messages
    frees: int = 0  # device bytes given back when it lands (what ``drain(nbytes)`` counts)
    began: Event | None = None  # set once started (a timing event on CUDA)
    done: Event | None = None  # set once started: completes when the copy has landed
    on_start: Callable[[Copy], None] | None = None
    on_landed: Callable[[Copy], None] | None = None
    on_failed: Callable[[Copy, BaseException], None] | None = None
    on_released: Callable[[Copy], None] | None = None  # its memory given back before it landed (``release``)
    released: bool = False

    def describe(self, error: BaseException) -> str:
        """What failed and which way, with the error's first 200 characters on one line."""
        return f"{self.label}, {WAYS[self.direction]} ({type(error).__name__}: {' '.join(str(error).split())[:200]})"


class CopyQueue:
    """Queued and in-flight copies per direction, oldest first, on ``streams``."""

    def __init__(self, streams: Streams, in_flight: int = IN_FLIGHT) -> None:
        self.streams = streams
        self.in_flight = in_flight
        self._queued: dict[str, deque[Copy]] = {OFFLOAD: deque(), PREFETCH: deque()}
        self._flying: dict[str, deque[Copy]] = {OFFLOAD: deque(), PREFETCH: deque()}

    @property
    def idle(self) -> bool:
        """No copy queued or in flight: the training loop's hooks' fast way out (hundreds of calls an iteration,
        so four plain tests rather than two generators)."""
        queued, flying = self._queued, self._flying
        return not (queued[OFFLOAD] or queued[PREFETCH] or flying[OFFLOAD] or flying[PREFETCH])

    def queued(self, direction: str) -> list[Copy]:
        """The copies in ``direction`` not started yet, oldest first."""
        return list(self._queued[direction])

    def pending_bytes(self, direction: str) -> int:
        """Bytes the copies in ``direction`` write, queued or not seen landed yet (``retire_landed`` first)."""
        self.retire_landed()
        copies = [*self._queued[direction], *self._flying[direction]]
        return sum(destination.nbytes for copy in copies for destination, _ in copy.pairs)

    def put(self, copy: Copy, now: bool = False) -> Copy:
        """Queue ``copy``; ``now``: start it at once (its stream waits on the device for ``after``)."""
        self._queued[copy.direction].append(copy)
        if now:
            self.start(copy)
        return copy

    def pump(self) -> None:
        """One point of the caller's loop: retire copies that have landed, start queued ones whose
        dependency has completed, at most ``in_flight`` per direction. Never waits; raises a failed copy."""
        self.retire_landed()
        for direction in (OFFLOAD, PREFETCH):
            flying, queued = self._flying[direction], self._queued[direction]
            while queued and len(flying) < self.in_flight:
                copy = queued[0]
                if copy.after is not None and not self._query(copy, copy.after):
                    break  # its dependency is still running: left for the next point
                queued.popleft()
                self._start(copy, device_wait=False)

    def retire_landed(self) -> None:
        """Retire the copies that have landed, oldest first per direction (no wait)."""
        for flying in self._flying.values():
            while flying and self._query(flying[0], flying[0].done):
                self._retire(flying.popleft())

    def flush(self, direction: str | None = None) -> None:
        """Start every queued copy (in ``direction``, default both) now; each stream waits on the device for
        dependencies already queued."""
        for way in (OFFLOAD, PREFETCH) if direction is None else (direction,):
            while self._queued[way]:
                self._start(self._queued[way].popleft(), device_wait=True)

    def start(self, copy: Copy) -> None:
        """Start a queued copy now, its stream waiting on the device for a dependency already queued."""
        self._queued[copy.direction].remove(copy)
        self._start(copy, device_wait=True)

    def cancel(self, copy: Copy) -> None:
        """Forget a copy that has not started; the memory it held goes back once the caller drops it."""
        self._queued[copy.direction].remove(copy)
        copy.pairs, copy.held = [], []

    def drain(self, nbytes: int | None = None) -> int:
        """Start every queued copy, then block the host until copies out have freed ``nbytes`` (default:
        every copy, both ways, landed), oldest first; returns the bytes freed. Not for the steady state."""
        freed = 0
        self.flush()
        for direction in (OFFLOAD,) if nbytes is not None else (OFFLOAD, PREFETCH):
            flying = self._flying[direction]
            while flying and (nbytes is None or freed < nbytes):
                copy = flying.popleft()
                try:
                    copy.done.synchronize()  # on the host: the caller needs this memory or data now
                except RuntimeError as error:
                    self._fail(copy, error)
                freed += copy.frees
                self._retire(copy)
        return freed

    def release(self, nbytes: int | None = None) -> int:
        """Give back the device memory copies out read, oldest first, until ``nbytes`` (default: all),
        without a host wait: each is started if still queued, the compute stream waits for it on the device,
        and the memory it read is dropped at once (``on_released``), for compute-stream work queued after
        that wait only. Each copy stays in flight until it has landed (``drain`` and failures see it).
        Returns the bytes given back."""
        freed = 0
        for copy in [*self._flying[OFFLOAD], *self._queued[OFFLOAD]]:
            if nbytes is not None and freed >= nbytes:
                break
            if copy.released:
                continue
            if copy.done is None:
                self.start(copy)
            # On the device: the compute stream's later work, which may be handed this memory by the
            # allocator, runs only once the copy has read it. The host goes on queueing.
            self.streams.wait(copy.done)
            freed += copy.frees
            copy.released, copy.frees = True, 0
            if copy.on_released is not None:
                copy.on_released(copy)
            copy.pairs, copy.held = [], []  # the last references: freed now, ordered by the wait above
        return freed

    def _start(self, copy: Copy, device_wait: bool) -> None:
        # A dependency that has completed needs no wait on the device at all.
        after = copy.after if device_wait and copy.after is not None and not copy.after.query() else None
        try:
            copy.began, copy.done = self.streams.copy(copy.direction, copy.pairs, after)
        except RuntimeError as error:
            self._fail(copy, error)
        self._flying[copy.direction].append(copy)
        if copy.on_start is not None:
            copy.on_start(copy)

    def _query(self, copy: Copy, event: Event) -> bool:
        try:
            return event.query()
        except RuntimeError as error:
            self._fail(copy, error)

    def _retire(self, copy: Copy) -> None:
        """The copy has landed: drop the memory it held (freed now, nothing reads it any more)."""
        if copy.on_landed is not None:
            copy.on_landed(copy)
        copy.pairs, copy.held = [], []

    def _fail(self, copy: Copy, error: BaseException) -> None:
        for waiting in (self._flying[copy.direction], self._queued[copy.direction]):
            if copy in waiting:
                waiting.remove(copy)
        if copy.on_failed is not None:
            copy.on_failed(copy, error)
        raise CopyError(f"megatron-offload: copy failed: {copy.describe(error)}") from error
