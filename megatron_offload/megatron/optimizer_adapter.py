"""Attach the engine to megatron-core's DistributedOptimizer(s): the handle the training loop's hooks
call, and the wrappers around the optimizer's step, state access and finalize function.

Every reach into megatron-core's internals it uses is in optimizer_internals.py, with the versions it
was checked against.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from megatron_offload.config.options import AUTO, OffloadConfig, PrefetchPolicy
from megatron_offload.core.gpu_memory import apply_memory_cap, expandable_segments_from_now, memory_limit_bytes
from megatron_offload.core.stats import OffloadStats
from megatron_offload.core.units import GIB, MIB
from megatron_offload.megatron.optimizer_internals import (
    _HANDLE_ATTR,
    CHECKED_MEGATRON_CORE_VERSIONS,
    STATE_ACCESS_METHODS,
    _after_wait,
    _check_compatible,
    _check_version,
    _in_last_microbatch,
    _master_weights,
    _save_from_host,
    _streamed_step_supported,
    _StreamedStep,
    distributed_optimizers,
)
from megatron_offload.megatron.pacing import PrefetchDuringBackward, RoomForForward
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader
from megatron_offload.optimizer_state.scheduler import Peaks, StateScheduler, whole_chunks

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKED_MEGATRON_CORE_VERSIONS",
    "OffloadFitError",
    "OffloadHandle",
    "attach_offloader",
    "distributed_optimizers",
]


class OffloadFitError(RuntimeError):
    """A setting keeps more optimizer state on the GPU than the memory limit leaves room for."""


class _PrefetchOnFinalize:
    """Wraps a TransformerConfig's ``finalize_model_grads_func``: starts the copy back, then finalizes,
    so the copy overlaps the gradient reduction. Keeps whatever function was there."""

    def __init__(self, inner: Callable[..., Any], handle: OffloadHandle) -> None:
        self.inner = inner
        self.handle = handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handle = self.handle
        if handle.scheduler.learned:  # iteration 1 measures the peaks without state: nothing back early
            # As much as the limit leaves beside what is allocated now and what the step will add; the
            # rest streams through the step (under a tight cap the whole state does not fit at once).
            allocated = torch.cuda.memory_allocated() if handle.on_cuda else 0
            room = handle.scheduler.backward_room(allocated + handle.step_footprint())
            handle.prefetch(max_bytes=max(0, room) if handle.on_cuda else None)
            for offloader in handle.offloaders:
                offloader.copies.flush()  # all of it now: no read of the host waits behind copies back
        return self.inner(*args, **kwargs)


class OffloadHandle:
    """What ``attach_offloader`` returns: the offloaders, their telemetry, and ``detach()``."""

    def __init__(self, optimizer: Any, config: OffloadConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self.offloaders: list[OptimizerStateOffloader] = []
        self.streamed = True  # every DistributedOptimizer runs the streamed step (else: whole state back)
        self.in_step = False  # True while optimizer.step() runs
        # The default (fraction "auto"): keep what fits under the limit. `step` with it: keep nothing.
        self.elastic = config.fraction == AUTO and config.prefetch is not PrefetchPolicy.STEP
        self.keeps_none = config.fraction == AUTO and not self.elastic
        self.on_cuda = torch.cuda.is_available()
        device = torch.cuda.current_device() if self.on_cuda else None
        self.scheduler = StateScheduler(lambda: memory_limit_bytes(device, config.gpu_memory_cap_bytes))
        self.say: Callable[[str], None] = logger.info  # the Megatron hooks print on the first rank instead
        self.hook_waits = 0
        self.step_backlog_bytes = 0
        self._pacer: PrefetchDuringBackward | None = None
        self._room: RoomForForward | None = None
        self._wrapped: list[tuple[Any, str, Any]] = []  # (object, attribute, what was there before)

    # ------------------------------------------------------------- what the hooks call (pacing.Handle)
    def pump(self) -> None:
        """A point of the training loop: start and retire copies, never wait (engine.pump)."""
        for offloader in self.offloaders:
            if not offloader.copies.idle:
                offloader.copies.pump()

    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False) -> int:
        """Start bringing state back, up to ``max_bytes`` (default: all); returns the bytes started."""
        started = 0
        for offloader in self.offloaders:
            room = None if max_bytes is None else max_bytes - started
            if room is not None and room <= 0:
                break
            started += offloader.prefetch(room, landed_only=landed_only)
        return started

    def moves(self) -> bool:
        """Some state leaves the GPU between steps (not all of it kept)."""
        return any(not chunk.kept for offloader in self.offloaders for chunk in offloader.chunks)

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

    def kept_bytes(self) -> int:
        """State kept on the GPU across steps."""
        return sum(offloader.kept_bytes for offloader in self.offloaders)

    def evict(self, nbytes: int) -> int:
        """Offload kept state now (memory ran short in the forward); it stays offloaded: the decision
        is lowered to what is still kept."""
        started = 0
        for offloader in self.offloaders:
            if started < nbytes:
                started += offloader.evict(nbytes - started)
        self.scheduler.lower([offloader.kept_bytes for offloader in self.offloaders])
        return started

    def step_footprint(self) -> int:
        return max((streamed_step.footprint(offloader) for offloader in self.offloaders), default=0)

    def count_hook_wait(self) -> None:
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
    def _before_step(self) -> None:
        if self.on_cuda:
            self.scheduler.start_step()  # the limit, read once for this iteration

    def _after_step(self, stepped: bool) -> None:
        """The state has left the step: learn the peaks (iteration 1's, with all state offloaded, are what
        training needs without it), decide what stays once (lowered if the peak grows), then wait until
        no more is pending than the next forward has room for."""
        if not self.on_cuda:
            return
        brought = self._pacer.brought if self._pacer is not None else 0
        peaks = Peaks(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        grew = self.scheduler.observe_step_end(peaks, resident=self.kept_bytes() + brought)
        if stepped and (grew or self.scheduler.kept is None):
            self._decide()
        budget = self.scheduler.backlog_budget(self.kept_bytes())
        self.step_backlog_bytes = self.pending_offload_bytes()
        if self.step_backlog_bytes > budget:
            # On the host: the next forward needs this memory, and only a landed copy frees it. Only
            # under a limit too tight for copies to overlap the forward (uncapped, the budget is large).
            self.drain_offloads(self.step_backlog_bytes - budget)

    def _decide(self) -> None:
        """What stays on the GPU, in bytes, by the scheduler: what fits (the default), nothing (``step``),
        or a fixed fraction's share, refused in one line when it does not fit."""
        sizes = [offloader.full_sizes() for offloader in self.offloaders]
        state, first = sum(map(sum, sizes)), self.scheduler.kept is None
        at_most = None if self.elastic else 0 if self.keeps_none else int((1.0 - self.config.fraction) * state)
        if first and at_most:
            wanted, room = sum(whole_chunks(at_most, sizes)), self.scheduler.room()
            if wanted > room:
                for offloader in self.offloaders:
                    offloader.keep_bytes(0)  # nothing stays: the state is whole in host memory
                raise OffloadFitError(
                    f"megatron-offload: --offload-fraction {self.config.fraction:g} keeps {wanted / GIB:.2f} GiB of "
                    f"optimizer state on the GPU, but the memory limit ({self.scheduler.limit() / GIB:.2f} GiB) leaves "
                    f"{room / GIB:.2f} GiB beside what training needs without it "
                    f"({self.scheduler.natural.reserved / GIB:.2f} GiB reserved at its peak): leave "
                    f"--offload-fraction out (keeps what fits), give {min(1.0, 1 - room / state + 0.005):.2f} or more, "
                    "or use --offload-prefetch step. The optimizer state is whole in host memory."
                )
        before = self.scheduler.kept
        kept = self.scheduler.decide(sizes, at_most)
        for offloader, nbytes in zip(self.offloaders, kept, strict=True):
            offloader.keep_bytes(nbytes)
        if self.elastic and kept != before:
            self.say(self.scheduler.explain(state))

    def smallest_footprint_note(self, peak_reserved: int, asked: int) -> str | None:
        """Where no state was on the GPU when memory ran out (the smallest footprint did not fit): what
        training needs without it and the limit, measured; else None (keeping less would have helped)."""
        if self.kept_bytes() or any(o.offloaded_bytes < o.plan.host_bytes for o in self.offloaders):
            return None
        state = sum(offloader.plan.full_bytes() for offloader in self.offloaders)
        return self.scheduler.too_small(peak_reserved, asked, state)

    def read_stats(self) -> OffloadStats:
        """Totals over every DistributedOptimizer on this rank (the peaks are the device's)."""
        total = OffloadStats()
        for offloader in self.offloaders:
            stats = offloader.read_stats()
            for field in fields(OffloadStats):
                value = getattr(stats, field.name)
                if field.name == "pinned":
                    total.pinned = total.pinned and value
                elif field.name in ("offloads", "prefetches", "peak_allocated_bytes", "peak_reserved_bytes"):
                    setattr(total, field.name, max(getattr(total, field.name), value))
                else:
                    setattr(total, field.name, getattr(total, field.name) + value)
        total.hook_waits, total.step_backlog_bytes = self.hook_waits, self.step_backlog_bytes
        return total

    def detach(self) -> None:
        """Bring all state back to the GPU and undo every wrapper. Safe to call twice."""
        for obj, name, before in reversed(self._wrapped):
            if name == "finalize_model_grads_func":
                if isinstance(obj.finalize_model_grads_func, _PrefetchOnFinalize):
                    obj.finalize_model_grads_func = obj.finalize_model_grads_func.inner
            elif before is None:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)
        self._wrapped.clear()
        for hooks in (self._pacer, self._room):
            if hooks is not None:
                hooks.remove()
        self._pacer = self._room = None
        for offloader in self.offloaders:
            offloader.restore()
        self.offloaders.clear()
        if getattr(self.optimizer, _HANDLE_ATTR, None) is self:
            delattr(self.optimizer, _HANDLE_ATTR)

    # ---------------------------------------------------------------------------------- wiring
    def _wrap_method(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        before = vars(obj).get(name)
        setattr(obj, name, make(getattr(obj, name)))
        self._wrapped.append((obj, name, before))

    def _install_finalize_hooks(self) -> None:
        """(Re)wrap each model config's finalize function. Training loops often set it after the
        optimizer is built, so this runs again after every step; it never wraps twice."""
        if self.config.prefetch is not PrefetchPolicy.FINALIZE:
            return
        for dist_opt in distributed_optimizers(self.optimizer):
            for chunk in dist_opt.model_chunks:
                model_config = chunk.config
                current = model_config.finalize_model_grads_func
                if current is None or isinstance(current, _PrefetchOnFinalize):
                    continue
                model_config.finalize_model_grads_func = _PrefetchOnFinalize(current, self)
                if not any(obj is model_config for obj, _, _ in self._wrapped):
                    self._wrapped.append((model_config, "finalize_model_grads_func", None))

    def _step_wrapper(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def step_with_offload(*args: Any, **kwargs: Any) -> Any:
            if self.in_step:
                raise RuntimeError("megatron-offload: optimizer.step() called again from inside a step")
            self.in_step, stepped = True, False
            try:
                self._before_step()
                if not self.streamed:
                    self.prefetch()  # the whole state, before megatron-core assigns the masters' grads
                    result = step(*args, **kwargs)
                else:
                    with contextlib.ExitStack() as stack:
                        for offloader in self.offloaders:
                            stack.enter_context(offloader.params_on_device())
                        result = step(*args, **kwargs)
                stepped = True
                return result
            finally:
                # Successful, skipped or failed: the state leaves in one piece, never half-way; its copies
                # start at the next points of the loop, a few at a time.
                for offloader in self.offloaders:
                    offloader.offload(now=False)
                    offloader.copies.pump()
                self._after_step(stepped)
                self._install_finalize_hooks()
                for hooks in (self._pacer, self._room):
                    if hooks is not None:
                        hooks.new_iteration()
                self.in_step = False

        return step_with_offload


def attach_offloader(optimizer: Any, config: OffloadConfig | None = None, **overrides: Any) -> OffloadHandle:
    """Offload the Adam state (and fp32 masters) of ``optimizer`` between steps.

    ``optimizer`` is what megatron-core's ``get_megatron_optimizer`` returned: a DistributedOptimizer or a
    ChainedOptimizer of them. Keyword overrides are OffloadConfig fields. Returns a handle; call
    ``handle.detach()`` to stop offloading and bring the state back.

    NOTE: ``gpu_memory_cap_gib`` caps the process from here on (what is allocated already counts against
    it) and stays set after ``detach()``, like expandable segments: it is the process's, not the handle's.
    """
    config = (config or OffloadConfig()).with_changes(**overrides)
    if getattr(optimizer, _HANDLE_ATTR, None) is not None:
        raise RuntimeError("an offloader is already attached to this optimizer; call detach() on it first")
    megatron_core_version = _check_version()
    dist_opts = distributed_optimizers(optimizer)
    for dist_opt in dist_opts:
        _check_compatible(dist_opt)

    handle = OffloadHandle(optimizer, config)
    try:
        allocator_note = expandable_segments_from_now()
        if allocator_note:
            logger.warning(allocator_note)
        handle.streamed = all(_streamed_step_supported(dist_opt) for dist_opt in dist_opts)
        for dist_opt in dist_opts:
            masters = _master_weights(dist_opt) if config.offload_master_weights else []
            keep = () if config.offload_master_weights else ("master_param",)
            offloader = OptimizerStateOffloader(
                dist_opt.optimizer,
                masters,
                keep_state_keys=keep,
                chunk_bytes=int(config.chunk_mb * MIB),
                # Everything leaves until iteration 1 has shown what training needs without state: then
                # the scheduler decides what stays (a fixed fraction is checked against the limit).
                fraction=1.0 if config.fraction == AUTO or handle.on_cuda else config.fraction,
                pin_memory=config.pin_memory,
                check_host_memory=config.check_host_memory,
            )
            handle.offloaders.append(offloader)
            # Anything that reads the state outside the step must see the copied-back values.
            waiting = ("step_with_ready_grads",) if not handle.streamed else ()
            for name in (*waiting, *STATE_ACCESS_METHODS):
                if hasattr(dist_opt, name):
                    loads = name.startswith("load")
                    handle._wrap_method(dist_opt, name, lambda inner, o=offloader, r=loads: _after_wait(inner, o, r))
            handle._wrap_method(dist_opt, "sharded_state_dict", lambda inner, o=offloader: _save_from_host(inner, o))
            if handle.streamed:
                streamed = _StreamedStep(dist_opt, offloader, handle._on_step_start)
                handle._wrap_method(dist_opt.optimizer, "step", lambda _inner, s=streamed: s.step)
                copy_name = "_copy_main_params_to_model_params"
                handle._wrap_method(dist_opt, copy_name, lambda _inner, s=streamed: s.copy_main_params_to_model_params)
        handle._wrap_method(optimizer, "step", handle._step_wrapper)
        handle._install_finalize_hooks()
        model_chunks = list({id(chunk): chunk for dist_opt in dist_opts for chunk in dist_opt.model_chunks}.values())
        if config.prefetch is PrefetchPolicy.AUTO:
            handle._pacer = PrefetchDuringBackward(handle, model_chunks, lambda: _in_last_microbatch(model_chunks))
        handle._room = RoomForForward(handle, model_chunks)
        setattr(optimizer, _HANDLE_ATTR, handle)
        # Out before the first forward, and landed: the masters exist already, iteration 1's peak counts
        # too, and iteration 1's forward learns its growth with nothing in flight.
        handle.offload()
        handle.drain_offloads()
        if config.gpu_memory_cap_gib is not None and handle.on_cuda:  # last: a refusal leaves the fraction as it was
            apply_memory_cap(config.gpu_memory_cap_gib, torch.cuda.current_device(), "OffloadConfig.gpu_memory_cap_gib")
    except BaseException:
        handle.detach()  # nothing half set up: no wrapper, hook or handle left behind
        raise
    logger.info(
        "megatron-offload attached to %d DistributedOptimizer(s) (megatron-core %s, %s)",
        len(dist_opts),
        megatron_core_version,
        config,
    )
    return handle
