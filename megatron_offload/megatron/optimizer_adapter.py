"""Attach the engine to megatron-core's DistributedOptimizer(s): an offloader per DistributedOptimizer, the
wrappers around its step and state access, and the handle (offload_handle.py) the training loop's hooks call.

Every reach into megatron-core's internals it uses is in optimizer_internals.py, with the versions it
was checked against, and streamed_step_internals.py (the streamed step's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_offload.config.options import AUTO, OffloadConfig, PrefetchPolicy
from megatron_offload.core.gpu_memory import (
    apply_memory_cap,
    every_segment_remappable,
    expandable_segments_from_now,
)
from megatron_offload.core.units import MIB
from megatron_offload.megatron.backward_prefetch import PrefetchDuringBackward
from megatron_offload.megatron.kept_decision import OffloadFitError
from megatron_offload.megatron.offload_handle import OffloadHandle
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
    distributed_optimizers,
)
from megatron_offload.megatron.pacing import RoomForForward
from megatron_offload.megatron.streamed_step_internals import _streamed_step_supported, _StreamedStep
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKED_MEGATRON_CORE_VERSIONS",
    "OffloadFitError",
    "OffloadHandle",
    "attach_offloader",
    "distributed_optimizers",
]


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
                    handle.wrappers.wrap(dist_opt, name, lambda inner, o=offloader, r=loads: _after_wait(inner, o, r))
            handle.wrappers.wrap(dist_opt, "sharded_state_dict", lambda inner, o=offloader: _save_from_host(inner, o))
            if handle.streamed:
                streamed = _StreamedStep(dist_opt, offloader, handle._on_step_start, handle.forward_hides)
                handle.streamed_steps.append(streamed)
                handle.wrappers.wrap(dist_opt.optimizer, "step", lambda _inner, s=streamed: s.step)
                copy_name = "_copy_main_params_to_model_params"
                handle.wrappers.wrap(dist_opt, copy_name, lambda _inner, s=streamed: s.copy_main_params_to_model_params)
        handle.wrappers.wrap(optimizer, "step", handle._step_wrapper)
        model_chunks = list({id(chunk): chunk for dist_opt in dist_opts for chunk in dist_opt.model_chunks}.values())
        handle.wrappers.model_chunks = model_chunks
        handle.wrappers.wrap_finalize_functions(handle)
        if config.prefetch is PrefetchPolicy.AUTO:
            handle._pacer = PrefetchDuringBackward(handle, model_chunks, lambda: _in_last_microbatch(model_chunks))
        # The first forward timed on training's stream, for the step to leave it what it hides (forward_hides).
        streams = handle.offloaders[0].streams if handle.offloaders else None
        clock = (lambda: streams.mark(timed=True)) if handle.on_cuda and streams is not None else None
        # Paced through the forward only where freed memory is usable by any request (expandable segments).
        handle._room = RoomForForward(handle, model_chunks, pace=every_segment_remappable(), clock=clock)
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
