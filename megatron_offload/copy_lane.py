"""Copies in one direction, issued by a helper thread that keeps few of them outstanding.

Why a thread, and why so few copies in flight (measured on an H100, see docs/engineering-notes.md):
- The copy engine serves device-to-host copies in the order they were queued, and keeps serving a
  stream that always has another copy waiting. Queue 10 GB of copy out at once and a loss ``.item()``
  behind it waits ~200 ms; issue the next chunk only once the previous one has landed and it waits
  for one chunk at most, with the link still near full speed.
- Every dependency of a copy (the compute work that wrote the chunk, the copy out that must finish
  before the host buffer is read back) is waited for on the host before the copy is issued, so no
  stream ever holds a wait that cannot proceed yet. With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` all
  streams share one hardware queue, and such a wait would hold back every kernel queued behind it.
- GPU memory a copy reads is freed (its last reference dropped) only once the copy has completed,
  so the allocator can hand it out at once. ``record_stream`` would free it at once in name only:
  the block stays unusable until some later allocation happens to poll the event, which fragments
  the pool and raises the reserved peak.

Nothing here imports CUDA: a job's ``issue`` queues the copies and returns what completes with them,
so the scheduling is tested on the CPU with stand-ins.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Completion", "CopyJob", "CopyLane"]

_running: weakref.WeakSet[CopyLane] = weakref.WeakSet()


@atexit.register
def _close_running_lanes() -> None:
    """Let every lane finish before the interpreter shuts down: a daemon thread stopped inside a CUDA
    wait at shutdown aborts the process (and copies still queued would be lost)."""
    for lane in list(_running):
        lane.close()


class Completion(Protocol):
    """Anything the host can wait for: a ``torch.cuda.Event``, another ``CopyJob``."""

    def synchronize(self) -> None: ...


@dataclass(eq=False)
class CopyJob:
    """The copies of one chunk in one direction."""

    issue: Callable[[], Completion | None] | None
    """Queues the copies (on the lane's stream) and returns what completes with them; dropped once they
    have completed, with whatever views of GPU memory it holds."""
    nbytes: int
    """GPU bytes the job holds until it is done (counted by ``CopyLane.pending_bytes``)."""
    ready: Completion | None = None
    """What must have finished before the copies may start; waited for on the host."""
    keep: list[Any] = field(default_factory=list)
    """References to the GPU memory the copies read; dropped (freed) once the copies have completed."""
    urgent: bool = False
    """Goes ahead of every queued job that is not urgent (the streamed step waits on these)."""
    completion: Completion | None = None
    error: BaseException | None = None
    issued: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def wait_issued(self) -> Completion | None:
        """Block until the copies are queued; returns their completion (for a device-side wait)."""
        self.issued.wait()
        self._raise()
        return self.completion

    def synchronize(self) -> None:
        """Block until the copies have completed and the memory they read is freed."""
        self.done.wait()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"megatron-offload: a copy of optimizer state failed: {self.error}") from self.error


class CopyLane:
    """A FIFO of copy jobs (urgent ones first) served by one daemon thread, ``max_in_flight`` at a time.

    NOTE: the thread needs the GIL only to issue a job; it waits for events with the GIL released.
    """

    def __init__(self, name: str, setup: Callable[[], None] = lambda: None, max_in_flight: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.name = name
        self.max_in_flight = max_in_flight
        self._setup = setup
        self._queue: queue.PriorityQueue[tuple[int, int, CopyJob | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._unfinished: deque[CopyJob] = deque()  # submitted and not done, in submission order
        self._pending_bytes = 0
        self._freed_bytes = 0  # by every job done so far
        self._thread: threading.Thread | None = None
        self.peak_in_flight = 0  # most jobs issued and not yet completed at once (for tests)

    @property
    def pending_bytes(self) -> int:
        """GPU bytes held by jobs not done yet."""
        return self._pending_bytes

    def submit(self, job: CopyJob) -> CopyJob:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
            _running.add(self)
        with self._lock:
            self._unfinished.append(job)
            self._pending_bytes += job.nbytes
        self._queue.put((0 if job.urgent else 1, next(self._order), job))
        return job

    def drain(self, nbytes: int | None = None) -> int:
        """Block until jobs holding at least ``nbytes`` (default: all) have finished from now on, waiting
        for the oldest first. Returns the bytes freed meanwhile."""
        start = self._freed_bytes
        while nbytes is None or self._freed_bytes - start < nbytes:
            with self._lock:
                job = self._unfinished[0] if self._unfinished else None
            if job is None:
                break
            job.synchronize()
        return self._freed_bytes - start

    def close(self) -> None:
        """Finish every job, then stop the thread."""
        if self._thread is None:
            return
        self._queue.put((2, next(self._order), None))  # after every job, urgent or not
        self._thread.join()
        self._thread = None
        _running.discard(self)

    def _serve(self) -> None:
        self._setup()
        in_flight: deque[CopyJob] = deque()
        while True:
            if in_flight and (len(in_flight) >= self.max_in_flight or self._queue.empty()):
                self._finish(in_flight.popleft())
                continue
            _, _, job = self._queue.get()
            if job is None:
                while in_flight:
                    self._finish(in_flight.popleft())
                return
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                job.completion = job.issue()
            except BaseException as error:  # handed to whoever waits for the job
                job.error = error
            job.issued.set()
            in_flight.append(job)
            self.peak_in_flight = max(self.peak_in_flight, len(in_flight))

    def _finish(self, job: CopyJob) -> None:
        try:
            if job.completion is not None and job.error is None:
                job.completion.synchronize()
        except BaseException as error:
            job.error = error
        job.keep.clear()  # the copies are done with this memory: free it now
        job.issue = None
        with self._lock:
            self._unfinished.remove(job)
            self._pending_bytes -= job.nbytes
            self._freed_bytes += job.nbytes
        job.done.set()
