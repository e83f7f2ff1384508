"""The handle ``attach_offloader`` returns: the offloaders of a megatron-core optimizer, what the training
loop's hooks call (pacing.Handle), the kept-bytes decision it composes (kept_decision.py), the wrapper
around the optimizer's step, telemetry and ``detach()``, which undoes what it put in place (wrappers.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from megatron_offload.config.options import OffloadConfig, PrefetchPolicy
from megatron_offload.core.gpu_memory import allocator_retries, memory_limit_bytes
from megatron_offload.core.stats import OffloadStats, totals
from megatron_offload.megatron import finalize_prefetch
from megatron_offload.megatron.backward_prefetch import PrefetchDuringBackward
from megatron_offload.megatron.kept_decision import KeptDecision
from megatron_offload.megatron.optimizer_internals import _HANDLE_ATTR
from megatron_offload.megatron.pacing import RoomForForward
from megatron_offload.megatron.streamed_step_internals import _StreamedStep
from megatron_offload.megatron.wrappers import Wrappers
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader
from megatron_offload.optimizer_state.scheduler import StateScheduler

logger = logging.getLogger(__name__)

__all__ = ["OffloadHandle"]


class OffloadHandle:
    """What ``attach_offloader`` returns: the offloaders, their telemetry, and ``detach()``."""

    def __init__(self, optimizer: Any, config: OffloadConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self.offloaders: list[OptimizerStateOffloader] = []
        self.streamed = True  # every DistributedOptimizer runs the streamed step (else: whole state back)
        self.in_step = self.backward_finished = False  # in optimizer.step(); backward_done ran in this iteration
        self.on_cuda = torch.cuda.is_available()
        device = torch.cuda.current_device() if self.on_cuda else None
        self.say: Callable[[str], None] = logger.info  # the Megatron hooks print on the first rank instead
        limit = lambda: memory_limit_bytes(device, config.gpu_memory_cap_bytes)  # noqa: E731
        self.decision = KeptDecision(config, limit, lambda text: self.say(text))
        self.hook_waits = self.step_backlog_bytes = 0
        self.brought_at_step = 0  # bytes started back once this iteration's backward was done (bring_back_for_step)
        self.quiet = False  # nothing moves, no copy under way: the hooks return at once (set at each step's end)
        self._pacer: PrefetchDuringBackward | None = None
        self._room: RoomForForward | None = None
        self.wrappers = Wrappers()  # undone at detach
        self.streamed_steps: list[_StreamedStep] = []  # each DistributedOptimizer's streamed step

    @property
    def scheduler(self) -> StateScheduler:
        return self.decision.scheduler

    # ------------------------------------------------------------- what the hooks call (pacing.Handle)
    def pump(self) -> None:
        """A point of the training loop: start and retire copies, never wait (CopyQueue.pump)."""
        for offloader in self.offloaders:
            if not offloader.copies.idle:
                offloader.copies.pump()

    @property
    def idle(self) -> bool:  # no copy queued or in flight anywhere: nothing to pump (hot: no generator)
        return not [offloader for offloader in self.offloaders if not offloader.copies.idle]

    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False, now: bool = False) -> int:
        """Start bringing state back, up to ``max_bytes`` (default: all; ``now``: Offloader.prefetch's); the bytes."""
        started = 0
        for offloader in self.offloaders:
            room = None if max_bytes is None else max_bytes - started
            if room is not None and room <= 0:
                break
            started += offloader.prefetch(room, landed_only=landed_only, now=now)
        return started

    def moving_chunks(self) -> list[int]:
        """The sizes of the chunks that leave the GPU between steps (those not kept)."""
        return [chunk.nbytes for offloader in self.offloaders for chunk in offloader.chunks if not chunk.kept]

    def pending_offload_bytes(self) -> int:
        """GPU bytes still held by offloads under way."""
        return sum(offloader.leaving_bytes for offloader in self.offloaders)

    def drain_offloads(self, nbytes: int | None = None) -> None:
        """Block until offloads have freed ``nbytes`` of GPU memory (default: all), oldest first."""
        for offloader in self.offloaders:
            freed = offloader.copies.drain(nbytes)
            if nbytes is not None:
                nbytes -= freed
                if nbytes <= 0:
                    return

    def release_offloads(self, nbytes: int | None = None) -> int:
        """Give back the GPU memory of offloads under way, oldest first, until ``nbytes`` (default: all),
        without a host wait: the compute stream waits for those copies on the device. Returns the bytes."""
        freed = 0
        for offloader in self.offloaders:
            if nbytes is not None and freed >= nbytes:
                break
            freed += offloader.copies.release(None if nbytes is None else nbytes - freed)
        return freed

    def kept_bytes(self) -> int:
        """State kept on the GPU across steps."""
        return self.decision.kept_bytes(self.offloaders)

    def gpu_state_bytes(self) -> int:
        """Optimizer state holding GPU memory now (kept, back early, or with a copy under way)."""
        return sum(offloader.gpu_state_bytes for offloader in self.offloaders)

    def evict(self, nbytes: int) -> int:
        """Offload kept state now (memory ran short in the forward); it stays offloaded: the decision
        is lowered to what is still kept."""
        self.quiet = False  # copies out from here on: every hook of the forward and the backward pumps them
        started = 0
        for offloader in self.offloaders:
            if started < nbytes:
                started += offloader.evict(nbytes - started)
        self.decision.lowered(self.offloaders)
        return started

    def step_footprint(self) -> int:
        return max((streamed_step.footprint(offloader) for offloader in self.offloaders), default=0)

    def left_to_forward(self) -> int:
        """Bytes of the early chunks' copies out the steps leave for the next forward's hooks (why: share_out.py), all
        offloaders together: what the link carries out while the first forward computes (its hooks pace them)."""
        ms = self._room.first_forward_ms if self._room is not None else None
        return int(self.link_out() * ms / 1000) if ms else 0

    def link_out(self) -> float:
        """Bytes per second the copies out reached, all offloaders together (at most the link's); 0 until timed."""
        out = totals(offloader.stats for offloader in self.offloaders)
        return out.bytes_offloaded / out.offload_seconds if out.offload_seconds > 0 else 0.0

    def forward_hides(self) -> int:
        """Each offloader's share of ``left_to_forward()`` (ShareOut's ``left`` in its step)."""
        return self.left_to_forward() // max(1, len(self.offloaders))

    def count_hook_wait(self) -> None:  # the forward's hooks had the compute stream (or the host) wait
        self.hook_waits += 1

    def _on_step_start(self) -> None:
        if self._pacer is not None:
            self._pacer.on_step_start()

    # ------------------------------------------------------------------------------ the user's
    def wait(self) -> None:
        for offloader in self.offloaders:
            offloader.wait()

    def offload(self) -> None:
        for offloader in self.offloaders:
            offloader.offload()

    # ------------------------------------------------------------------------------ scheduling
    def backward_done(self) -> None:
        """Backward is done, once an iteration: as megatron-core's finalize function begins (before its gradient checks
        make the host wait for the GPU: finalize_prefetch.py), else as the step begins. Learn the limit, then start back
        what the backward did not bring, as far as the step leaves room (``step``: its staging buffers), on the device
        after the backward: beside megatron-core's work ahead of Adam."""
        if not self.on_cuda or self.backward_finished:
            return
        self.backward_finished = True  # until the step has ended
        self.decision.before_step()
        if self._pacer is not None:
            self._pacer.on_backward_done()  # before more comes back: its retries are the backward's
        if self.streamed and self.config.prefetch is not PrefetchPolicy.STEP:
            self.brought_at_step = finalize_prefetch.bring_back_for_step(self)
        elif self.streamed:
            for streamed in self.streamed_steps:
                streamed.begin_staging()  # the state's copies in beside megatron-core's work ahead of Adam

    def _after_step(self, stepped: bool) -> None:
        """The state has left the step: the decision learns the peaks and decides what stays (KeptDecision). Once the
        forward's hooks pace the copies out (RoomForForward) they stay pending; before, wait until the peak has room."""
        self.backward_finished = False  # the next backward_done is the next iteration's
        if not self.on_cuda:
            return
        brought, self.brought_at_step = self.brought_at_step + (self._pacer.brought if self._pacer else 0), 0
        self.decision.after_step(self.offloaders, stepped, brought)
        budget = self.scheduler.backlog_budget(self.kept_bytes())
        self.step_backlog_bytes = self.pending_offload_bytes()
        if self.step_backlog_bytes > budget and not (self._room is not None and self._room.paces):
            # On the host: the forward needs this memory and no hook learned when (iteration 1, or no hooks).
            self.drain_offloads(self.step_backlog_bytes - budget)

    def smallest_footprint_note(self, peak_reserved: int, asked: int) -> str | None:  # KeptDecision's, over ours
        return self.decision.smallest_footprint_note(self.offloaders, peak_reserved, asked)

    def read_stats(self) -> OffloadStats:
        """Totals over every DistributedOptimizer on this rank (the peaks are the device's)."""
        total = totals(offloader.read_stats() for offloader in self.offloaders)
        total.hook_waits, total.step_backlog_bytes = self.hook_waits, self.step_backlog_bytes
        # Process-wide, read when a log line asks: each retry stalled the host behind every copy in flight.
        total.allocator_retries = allocator_retries() if self.on_cuda else 0
        return total

    def detach(self) -> None:
        """Bring all state back to the GPU and undo every wrapper. Safe to call twice."""
        self.wrappers.undo()
        for hooks in filter(None, (self._pacer, self._room)):
            hooks.remove()
        self._pacer = self._room = None
        for offloader in self.offloaders:
            offloader.restore()
        self.offloaders.clear()
        self.streamed_steps.clear()
        if getattr(self.optimizer, _HANDLE_ATTR, None) is self:
            delattr(self.optimizer, _HANDLE_ATTR)

    # ---------------------------------------------------------------------------------- wiring
    def _step_wrapper(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def step_with_offload(*args: Any, **kwargs: Any) -> Any:
            if self.in_step:
                raise RuntimeError("megatron-offload: optimizer.step() called again from inside a step")
            self.in_step, stepped = True, False
            try:
                self.backward_done()  # unless megatron-core's finalize function did already
                if not self.streamed:
                    self.prefetch()  # the whole state, before megatron-core assigns the masters' grads
                    result = step(*args, **kwargs)
                else:
                    with contextlib.ExitStack() as stack:
                        for offloader in self.offloaders:
                            stack.enter_context(offloader.device_view.params_on_device())
                        result = step(*args, **kwargs)
                stepped = True
                return result
            finally:
                # Successful, skipped or failed: the state leaves in one piece, never half-way; its copies start
                # at the next points of the loop, a few at a time.
                for streamed in self.streamed_steps:
                    streamed.drop_staging()
                for offloader in self.offloaders:
                    offloader.offload(now=False)
                    offloader.copies.pump()
                self._after_step(stepped)
                self.wrappers.wrap_finalize_functions(self)
                self.quiet = not self.moving_chunks() and self.idle
                for hooks in filter(None, (self._pacer, self._room)):
                    hooks.new_iteration()
                self.in_step = False

        return step_with_offload
