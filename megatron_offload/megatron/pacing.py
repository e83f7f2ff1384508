"""The training loop's points: hooks where the copies move (``handle.pump()``, never a wait), and
where memory is paced: here, when the forward must free memory (what may come back during backward:
backward_prefetch.py).

Installed on about ``SAMPLES`` places per pass (every k-th module or parameter): a few dozen calls per
forward and backward. They know the handle and its scheduler only, nothing of Megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from megatron_offload.core.gpu_memory import allocated_bytes
from megatron_offload.optimizer_state.scheduler import StateScheduler

__all__ = ["Handle", "RoomForForward", "sampled"]

SAMPLES = 64  # hooks per backward, and per forward
# A forward reads memory (tens of microseconds of host time, which the GPU waits for where the loop is
# host-bound) at its first hook after a step, then at every READ_EVERY-th, or every READ_SPARSE-th while the
# last reading left room for the rest of the forward and a whole forward's growth twice over: enough to see a
# forward grow. Between readings, hooks with copies out pending go by the last reading and what the first
# iteration added since then.
READ_EVERY = 4
READ_SPARSE = 32
LOOKAHEAD = 2  # hooks ahead a forward makes room for: what one module allocates and frees between hooks


class Handle(Protocol):
    """What the hooks need of an OffloadHandle."""

    scheduler: StateScheduler
    quiet: bool  # nothing moves and no copy is under way (set at each step's end): the backward's hooks return at once
    idle: bool  # no copy queued or in flight now: the forward's hooks return at once between readings

    def pump(self) -> None: ...
    def moving_chunks(self) -> list[int]: ...
    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False, now: bool = False) -> int: ...
    def pending_offload_bytes(self) -> int: ...
    def drain_offloads(self, nbytes: int | None = None) -> None: ...
    def release_offloads(self, nbytes: int | None = None) -> int: ...
    def kept_bytes(self) -> int: ...
    def gpu_state_bytes(self) -> int: ...
    def evict(self, nbytes: int) -> int: ...
    def step_footprint(self) -> int: ...
    def count_hook_wait(self) -> None: ...
    def left_to_forward(self) -> int: ...


class RoomForForward:
    """Paces the copies out through the forward, and frees memory should the scheduler's forecast not hold.

    The first forward records what training needs without state (the highest reading so far at each
    hook). Later forwards give back, at each hook, just the copies out that the forward needs room for up
    to ``LOOKAHEAD`` hooks on, by that profile (from where it reached its top, a backward follows: up to the
    natural peak). The compute stream waits for those copies on the device, never the host, and the other
    copies run beside the forward. Memory is read every few hooks (``READ_EVERY``, ``READ_SPARSE``); a hook
    between readings takes what the training holds as the last reading plus the most the first iteration
    added from that hook to this one (``naturals``): as read where the forward repeats the first, never less.
    If a reading plus what the rest of the first forward added would pass the limit even with every copy out
    landed (the workload grew), every copy out is given back and kept state goes too: slower, never out of
    memory where offloading fits; a forward that grew is seen at the next reading. With no copy queued or in
    flight (the handle's ``idle``: the later forwards, or the whole state kept), the hooks between readings return
    at once: in a host-bound forward their time is the GPU's.
    Given a ``clock``, each first forward is also timed, on the device, from its first hook to its last
    (``first_forward_ms``, the shortest so far).

    ``pace`` False (some of the allocator's memory is in fixed-size segments, see
    ``gpu_memory.every_segment_remappable``): memory freed in the middle of the forward would leave holes
    only requests that fit can use, so the step's end waits for what the forward's peak has no room for,
    and a hook waits on the host, for the room up to the forward's top, only should the forecast not hold.
    """

    def __init__(
        self,
        handle: Handle,
        model_chunks: Sequence[torch.nn.Module],
        pace: bool = True,
        clock: Callable[[], Any] | None = None,
    ) -> None:
        self.handle = handle
        self.pace = pace
        self.clock = clock  # a timed event on the compute stream (Streams.mark); None: the forward is not timed
        modules = {
            id(module): module
            for chunk in model_chunks
            for module in chunk.modules()
            if next(module.parameters(recurse=False), None) is not None
        }
        self.hooks = [
            module.register_forward_pre_hook(self.before_forward) for module in sampled(list(modules.values()))
        ]
        self.on_gpu = torch.cuda.is_available()
        self.calls = 0
        self.learning = True  # the first iteration: record the profile
        self.profile: list[int] = []  # highest natural reading up to each hook of the first iteration
        self.naturals: list[int] = []  # the natural reading at each hook of the first iteration
        self.last_read = (0, 0)  # this iteration's latest reading: its hook (index), what training and kept state held
        self.peaks: list[int] = []  # the allocator's highest allocation so far at each hook (between hooks too)
        self.top = 0  # the first hook where the profile reached its highest reading
        self.next_read = 0  # the hook (``calls``) whose memory is read next
        self.waited = 0  # times a forward had the compute stream wait for copies out (for tests and the log)
        self.first_forward_ms: float | None = None  # the shortest first forward so far, first hook to last
        self._marks: list[Any] = []  # this iteration's first forward: events at its first and last hook

    @property
    def paces(self) -> bool:
        """The profile is learned: the step may leave its copies out pending for the forward to pace."""
        return self.pace and not self.learning and bool(self.profile)

    def before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self.on_gpu:
            return
        self.calls += 1
        if self.calls < self.next_read and self.calls != len(self.hooks) and self.handle.idle:
            return  # no copy to start or retire, none pending, no reading due (the last hook times the forward)
        self.handle.pump()
        if self.clock is not None and not self.learning and self.calls in (1, len(self.hooks)):
            # Read after the step, without waiting: how long the first forward computes, for the step to
            # leave it the copies out it can hide (OffloadHandle.forward_hides).
            self._marks.append(self.clock())
        if self.learning:
            pending = self.handle.pending_offload_bytes()
            natural = allocated_bytes() - pending - self.handle.kept_bytes()
            self.naturals.append(natural)
            self.profile.append(max(natural, self.profile[-1] if self.profile else natural))
            self.peaks.append(allocated_bytes(peak=True) - pending - self.handle.kept_bytes())
            if pending:  # nothing learned yet: let everything land first
                self.handle.count_hook_wait()
                self.handle.drain_offloads(None)
            return
        pending = self.handle.pending_offload_bytes()
        if not self.profile or (self.calls < self.next_read and not pending):
            return  # nothing leaving and no reading due: a reading every few hooks is enough to see a forward grow
        headroom = self.handle.scheduler.headroom()
        index = min(self.calls, len(self.profile)) - 1
        if self.calls >= self.next_read:
            held = allocated_bytes() - pending  # training's and the kept state's, without the copies out
            self.last_read = (index, held)
            grown = held + self.profile[-1] - self.profile[index] - headroom
            growth = self.profile[-1] - self.profile[0]  # what one forward adds, by the profile
            self.next_read = self.calls + (READ_SPARSE if -grown >= 2 * growth else READ_EVERY)
            if grown > 0:
                if pending:
                    self._release(None)
                if self.handle.kept_bytes():
                    self.handle.evict(grown)  # kept state out for good: the scheduler re-chooses after the step
                    self._release(None)
                return
        else:
            # Kept state evicted since the reading counts twice (in it and pending) until the next: more room.
            held = self._since_read(index)
        allocated = held + pending
        if pending and allocated + self._ahead(index) > headroom:
            self._release(min(pending, allocated + self._ahead(index) - headroom))

    def _since_read(self, index: int) -> int:
        """What training and kept state hold at hook ``index`` between readings: the latest reading plus the most
        the first iteration added from that reading's hook up to this one (none where it only freed)."""
        read, held = self.last_read
        if index <= read:
            return held
        return held + max(0, max(self.naturals[read + 1 : index + 1]) - self.naturals[read])

    def _ahead(self, index: int) -> int:
        """What the forward adds from hook ``index`` to ``LOOKAHEAD`` hooks on, by the first forward's
        profile, with what a module allocates and frees between two hooks (the allocator's peak then); from
        the profile's top on, up to the natural peak (the backward's, the step's). Not pacing: up to the top."""
        if not self.pace:
            return max(0, self.profile[-1] - self.profile[index])
        if index < self.top:
            return max(0, self.peaks[min(index + LOOKAHEAD, self.top)] - self.profile[index])
        natural = self.handle.scheduler.natural
        return max(0, (natural.allocated if natural is not None else self.profile[-1]) - self.profile[index])

    def _release(self, nbytes: int | None) -> None:
        self.waited += 1
        self.handle.count_hook_wait()
        if self.pace:
            self.handle.release_offloads(nbytes)
        else:
            # On the host: only a landed copy frees memory that fixed-size segments can hand out whole.
            self.handle.drain_offloads(nbytes)

    def new_iteration(self) -> None:
        """Called after every step: the first forward's profile is complete; its time is read if its events
        have completed (never a wait), the shortest kept: a forward that waited for copies out ran longer."""
        if self.learning and self.calls:
            self.learning = False
            self.top = self.profile.index(self.profile[-1]) if self.profile else 0
        if len(self._marks) == 2 and self._marks[1].query():
            ms = self._marks[0].elapsed_time(self._marks[1])
            self.first_forward_ms = ms if self.first_forward_ms is None else min(self.first_forward_ms, ms)
        self._marks.clear()
        self.calls, self.next_read = 0, 0  # the first hook after a step reads: the step moved memory

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def sampled(items: list) -> list:
    """About SAMPLES of ``items``, evenly spread, the first always among them (up to twice as many: the step
    rounds down). NOTE: the hooks' density is part of the memory rule, not only host time: the backward's
    margin is learned between two readings and the forward releases copies a few hooks ahead. Capped at
    SAMPLES (63 forward and 55 gradient hooks instead of 125 and 82 for configs/gpt_0p9b.yaml), the default
    under caps forcing 75% and 90% of its state off the GPU ran out of memory in a backward."""
    return items[:: max(1, len(items) // SAMPLES)]
