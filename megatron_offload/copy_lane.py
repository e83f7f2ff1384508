"""Copies in one direction, issued by a helper thread that keeps few of them outstanding.

Why a thread, and why so few copies in flight (measured on an H100, see docs/engineering-notes.md):
- The copy engine serves device-to-host copies in the order they were queued, and keeps serving a
  stream that always has another copy waiting. Issue the next chunk only once the previous one has
  landed and a loss ``.item()`` waits for one chunk at most, with the link still near full speed.
- Every dependency of a copy is waited for on the host before the copy is issued, so no stream ever
  holds a wait that cannot proceed yet (with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` it would hold back
  every kernel queued behind it).
- GPU memory a copy reads is freed only once the copy has completed, so the allocator can hand it out
  at once (``record_stream`` would free it in name only and fragment the pool).

Failures (issue 15): whatever fails (the thread's setup, waiting for a dependency, queuing the copies,
the copy itself) becomes a ``CopyLaneError`` on the job, naming its ``label``, raised by every wait on
it and by ``CopyLane.check()``. A failed job keeps its ``keep`` references for good: copies it queued
may still read them, and a failed copy out's GPU block is the only whole copy of its chunk. Waits
never block on a lane that can no longer serve: a thread that died, a lane left behind by a bounded
``close``, or a lane in a forked child (a data-loader worker) fails its jobs instead.

Nothing here imports CUDA: a job's ``issue`` queues the copies and returns what completes with them,
so the scheduling and every failure path are tested on the CPU with stand-ins.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_offload.units import MIB

__all__ = ["Completion", "CopyJob", "CopyLane", "CopyLaneError"]

EXIT_TIMEOUT_S = float(os.environ.get("MEGATRON_OFFLOAD_EXIT_TIMEOUT_S", "60"))
"""How long process exit waits for the lanes to finish their copies before leaving them behind."""
POLL_S = 0.05
"""How often a waiting thread looks whether the lane behind its job can still serve it."""
_RESUME = "stop and resume from the last complete checkpoint"

_running: weakref.WeakSet[CopyLane] = weakref.WeakSet()  # lanes whose thread is started


class CopyLaneError(RuntimeError):
    """A copy of offloaded optimizer state failed, or its lane can no longer serve (message says which)."""


@atexit.register
def _close_running_lanes() -> None:
    """Let every lane finish its copies before the interpreter shuts down (a daemon thread stopped
    inside a CUDA wait at shutdown aborts the process), but never wait forever: a copy stuck behind
    GPU work that never completes (a hung collective) would hang exit."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for lane in list(_running):
        lane.close(timeout=max(0.0, deadline - time.monotonic()))


class Completion(Protocol):
    """Anything the host can wait for: a ``torch.cuda.Event``, another ``CopyJob``."""

    def synchronize(self) -> None: ...


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


@dataclass(eq=False)
class CopyJob:
    """The copies of one chunk in one direction."""

    issue: Callable[[], Completion | None] | None
    """Queues the copies (on the lane's stream) and returns what completes with them; dropped once they
    have completed (or failed), with whatever views of GPU memory it holds."""
    nbytes: int
    """GPU bytes the job holds until it is done (counted by ``CopyLane.pending_bytes``)."""
    ready: Completion | None = None
    """What must have finished before the copies may start; waited for on the host."""
    keep: list[Any] = field(default_factory=list)
    """References to the memory the copies read; dropped once they have completed, kept if they failed."""
    urgent: bool = False
    """Goes ahead of every queued job that is not urgent (the streamed step waits on these)."""
    completion: Completion | None = None
    error: BaseException | None = None
    """A ``CopyLaneError`` naming the job (its ``__cause__`` is what failed); set before issued/done."""
    issued: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    label: str = ""
    """Names the chunk and direction in errors, e.g. "chunk 3 of 17 (64.0 MiB), GPU to host"."""
    lane: CopyLane | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.label or f"a copy of {self.nbytes / MIB:.1f} MiB"

    def wait_issued(self, timeout: float | None = None) -> Completion | None:
        """Block until the copies are queued; returns their completion (for a device-side wait)."""
        self._wait(self.issued, "queued", timeout)
        return self.completion

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the copies have completed and the memory they read is freed."""
        self._wait(self.done, "completed", timeout)

    def _wait(self, event: threading.Event, what: str, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        # Polled, not one wait: a lane that can no longer serve never sets the event; it fails its jobs
        # when it notices (most cases), and here we look ourselves (a thread that died unnoticed).
        while not event.wait(POLL_S):
            if self.lane is not None:
                self.lane._notice_dead_thread()
            if deadline is not None and time.monotonic() >= deadline and not event.is_set():
                raise CopyLaneError(
                    f"megatron-offload: {self.name} was not {what} within {timeout:g} s; a copy waits for GPU "
                    f"work that does not complete (a hung collective?); {_RESUME}."
                )
        if self.error is not None:
            raise CopyLaneError(str(self.error)) from self.error


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
        self._owner_pid = os.getpid()
        self.broken: CopyLaneError | None = None  # set once the lane can serve no job at all
        self.failed: CopyLaneError | None = None  # the first failure of any job (or of the lane)
        self.peak_in_flight = 0  # most jobs issued and not yet completed at once (for tests)

    @property
    def pending_bytes(self) -> int:
        """GPU bytes held by jobs not done yet."""
        return self._pending_bytes

    def check(self) -> None:
        """Raise the lane's first failure now, for the training thread to stop where it can act on it."""
        if self.failed is not None:
            raise CopyLaneError(str(self.failed)) from self.failed

    def submit(self, job: CopyJob) -> CopyJob:
        """Queue ``job``; raises at once (before the caller points any tensor at its result) if the lane
        can no longer serve."""
        with self._lock:  # the check and the append as one: a lane breaking meanwhile fails every job it has
            if self.broken is not None:
                raise CopyLaneError(f"megatron-offload: {job.name} was not started: {self.broken}")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
                _running.add(self)
            job.lane = self
            self._unfinished.append(job)
            self._pending_bytes += job.nbytes
        self._queue.put((0 if job.urgent else 1, next(self._order), job))
        return job

    def drain(self, nbytes: int | None = None) -> int:
        """Block until jobs holding at least ``nbytes`` (default: all) have finished from now on, waiting
        for the oldest first. Returns the bytes freed meanwhile. Raises the lane's first failure, even one
        nobody waited for: "every copy has landed" is not true of a lane where one failed."""
        start = self._freed_bytes
        while nbytes is None or self._freed_bytes - start < nbytes:
            with self._lock:
                job = self._unfinished[0] if self._unfinished else None
            if job is None:
                break
            job.synchronize()
        self.check()
        return self._freed_bytes - start

    def close(self, timeout: float | None = None) -> bool:
        """Finish every job, then stop the thread. After ``timeout`` seconds give up instead: say so on
        stderr, fail the jobs left (their waits raise) and return False."""
        thread = self._thread
        if thread is None:
            return True
        self._queue.put((2, next(self._order), None))  # after every job, urgent or not
        thread.join(timeout)  # bounded when asked: a copy may wait for GPU work that never completes
        if thread.is_alive():
            with self._lock:
                stuck = self._unfinished[0].name if self._unfinished else "its last copy"
            reason = f"did not finish within {timeout:.1f} s (stuck on {stuck}) and was left behind"
            print(
                f"megatron-offload: copy lane {self.name} {reason}; host copies may be incomplete, so {_RESUME}.",
                file=sys.stderr,
                flush=True,
            )
            self._break(reason, None)
            return False
        self._thread = None
        _running.discard(self)
        return True

    # ------------------------------------------------------------------------- the lane's thread
    def _serve(self) -> None:
        try:
            self._setup()
        except BaseException as error:  # without its setup the lane cannot copy: fail every job, now and later
            self._break(f"its thread's setup failed ({_one_line(error)})", error)
            return
        try:
            self._serve_jobs()
        except BaseException as error:  # a bug here must not leave anyone waiting for a thread that is gone
            self._break(f"its thread stopped ({_one_line(error)})", error)

    def _serve_jobs(self) -> None:
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
            stage = "while waiting for what it depends on"
            try:
                if job.ready is not None:
                    job.ready.synchronize()  # on the host: the copy must not start before its inputs are final
                stage = "while queuing its copies"
                job.completion = job.issue()
            except BaseException as error:  # handed to whoever waits for the job
                self._fail(job, stage, error)
            job.issued.set()  # after the error is set: wait_issued must see it
            in_flight.append(job)
            self.peak_in_flight = max(self.peak_in_flight, len(in_flight))

    def _finish(self, job: CopyJob) -> None:
        if job.error is None and job.completion is not None:
            try:
                job.completion.synchronize()  # the copies must have landed before their memory is freed
            except BaseException as error:
                self._fail(job, "while copying", error)
        if job.error is None:
            job.keep.clear()  # the copies are done with this memory: free it now
        # A failed job keeps ``keep``: copies it queued may still read it, and it may be the only whole copy.
        job.issue = None
        self._retire(job)

    def _fail(self, job: CopyJob, stage: str, error: BaseException | None) -> None:
        cause = f" ({_one_line(error)})" if error is not None else ""
        job.error = CopyLaneError(
            f"megatron-offload: copy of optimizer state failed: {job.name}, lane {self.name}, {stage}{cause}; "
            f"its data did not arrive and the memory it read is kept; {_RESUME}."
        )
        job.error.__cause__ = error
        if self.failed is None:
            self.failed = job.error

    def _retire(self, job: CopyJob) -> None:
        """Count the job as done and wake its waiters (once, whoever gets there first)."""
        with self._lock:
            if job.done.is_set():
                return
            self._unfinished.remove(job)
            self._pending_bytes -= job.nbytes
            self._freed_bytes += job.nbytes
            job.issued.set()  # a job failed before it was issued must not leave wait_issued blocked
            job.done.set()

    def _break(self, reason: str, error: BaseException | None) -> None:
        """The lane can serve nothing more: refuse new jobs and fail every job it still has."""
        with self._lock:  # with submit's check: no job slips in after this
            if self.broken is None:
                self.broken = CopyLaneError(f"megatron-offload: copy lane {self.name} {reason}; {_RESUME}.")
                self.broken.__cause__ = error
            jobs = list(self._unfinished)
        for job in jobs:
            if job.error is None:
                self._fail(job, f"because the lane {reason}", None)
                job.error.__cause__ = error
            self._retire(job)
        if self.failed is None:
            self.failed = self.broken

    def _notice_dead_thread(self) -> None:
        thread = self._thread
        if thread is not None and not thread.is_alive() and self.broken is None:
            self._break("lost its thread", None)

    # --------------------------------------------------------------------------------- fork
    def _after_fork_in_child(self) -> None:
        """The child has this lane's memory but not its thread: nothing here may wait on or use it."""
        self._lock = threading.Lock()  # whatever the parent held at fork time, it is free here
        self._queue = queue.PriorityQueue()
        self._thread = None
        for job in self._unfinished:  # their events' internal locks may be held as well: fresh ones
            job.issued, job.done = threading.Event(), threading.Event()
        reason = (
            f"belongs to process {self._owner_pid}, and this process ({os.getpid()}) is a fork of it (a data-loader "
            "worker?) without the lane's thread: only the training process may copy optimizer state"
        )
        self._break(reason, None)
        _running.discard(self)


def _before_fork() -> None:
    for lane in list(_running):
        lane._lock.acquire()  # so that no lane's bookkeeping is half done in the child


def _after_fork_in_parent() -> None:
    for lane in list(_running):
        lane._lock.release()


def _after_fork_in_child() -> None:
    for lane in list(_running):
        lane._after_fork_in_child()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
