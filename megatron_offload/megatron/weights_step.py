"""The optimizer step of weight streaming as one streamed pass over host memory.

With ``--offload-weights`` the gradients (fp32) and masters (fp32) live in device-mapped host memory,
and megatron-core's step reads them there pass after pass. ``attach_streamed_step`` wires, behind
megatron-core's own calls (step_internals.py names each one):
- ``skip_zeroing``: DDP's zeroing of the gradient buffer at each step's start is left out; the streamer's
  first copy out of each layer's gradients in a step writes all of them from a slot that started at zero
  (weights/streamer.py says why that is exact);
- ``norms``: the gradient norm and DDP's NaN/Inf check are made from per-tensor norms the streamer takes
  while each layer's gradients sit in their GPU slot after the last micro-batch (the optimizer's norm
  bitwise megatron-core's; where a norm is missing, megatron-core's own pass runs);
- ``staged``: each chunk of the optimizer-state offloader's streamed step brings its masters and
  gradients to the GPU, clips the gradients there (megatron-core's clipping, deferred to the chunk), runs
  Adam and the master-to-model copy on them, and writes the masters back: each byte crosses once, on the
  side streams, the next chunk coming in while one is updated and the one before goes out.
Each piece can be left off (for comparison with megatron-core's own passes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_offload.core.patches import InstancePatches
from megatron_offload.megatron.optimizer_internals import _in_last_microbatch, distributed_optimizers
from megatron_offload.megatron.step_internals import (
    ClipDeferral,
    check_grads_from_slots,
    local_norm_kernels,
    norm_of_norms,
    reset_without_zeroing,
)
from megatron_offload.megatron.streamed_step_internals import streamed_step_of
from megatron_offload.megatron.weights_adapter import WeightHandle
from megatron_offload.optimizer_state.staged_params import StagedParams
from megatron_offload.optimizer_state.streamed_step import footprint
from megatron_offload.weights.grad_norms import SlotNorms

__all__ = ["StepParts", "StreamedStepHandle", "attach_streamed_step"]


@dataclass(frozen=True)
class StepParts:
    """Which of megatron-core's passes over host memory the streamed step replaces (all by default)."""

    skip_zeroing: bool = True
    """Leave out DDP's zeroing of the host gradients (the first copy out of each layer overwrites them)."""
    norms: bool = True
    """Gradient norm and NaN/Inf check from the per-tensor norms taken in the GPU slots."""
    staged: bool = True
    """Masters and gradients through the GPU per chunk, clipping deferred into the chunks."""


@dataclass
class StreamedStepHandle:
    """What ``attach_streamed_step`` did, so that it can be undone (``detach``)."""

    weights: WeightHandle
    norms: SlotNorms | None = None
    stages: list[StagedParams] = field(default_factory=list)
    staged_steps: list[Any] = field(default_factory=list)
    """The offloaders' streamed steps given a stage (the stage is taken off again at detach)."""
    patches: InstancePatches = field(default_factory=InstancePatches)
    deferral: ClipDeferral | None = None
    clipped_params: list[Any] = field(default_factory=list)
    slot_norm_steps: int = 0
    """Steps whose gradient norm came from the slots (the rest: megatron-core's own pass)."""

    def detach(self) -> None:
        self.patches.undo()
        if self.deferral is not None:
            self.deferral.unregister(self.clipped_params)
            self.deferral = None
        streamer = self.weights.streamer
        streamer.settle()  # a stale gradient is zeroed now, as megatron-core would have
        streamer.norms, streamer.last_microbatch = None, lambda: True
        for stage in self.stages:
            stage.end_step()
        for step in self.staged_steps:
            step.stage = None
        self.staged_steps = []


def attach_streamed_step(
    optimizer: Any,
    weights: WeightHandle,
    model_chunks: list[Any],
    parts: StepParts = StepParts(),
    offload: Any = None,
) -> StreamedStepHandle:
    """Make the step of ``optimizer`` (megatron-core's, with attach_offloader's streamed step in place)
    over ``model_chunks`` streamed by ``weights`` one pass; see the module docstring. ``offload``:
    attach_offloader's handle, whose step footprint then counts the staged step's buffers."""
    handle = StreamedStepHandle(weights)
    streamer = weights.streamer
    try:
        if parts.skip_zeroing:
            for chunk in model_chunks:
                for buffer in chunk.buffers:
                    # The buffer's gradients hold the last step's values until each unit's first copy out.
                    handle.patches.replace(buffer, "reset", reset_without_zeroing(buffer, streamer.skip_zeroing))
        if parts.norms and local_norm_kernels():
            handle.norms = SlotNorms()
            for unit in streamer.layers + ([streamer.resident] if streamer.resident is not None else []):
                for placed in unit.placed:
                    if placed.host_grad is not None:
                        handle.norms.watch(unit.index, placed.host_grad, placed.offset)
            streamer.norms = handle.norms
            streamer.last_microbatch = lambda: _in_last_microbatch(model_chunks)
            for chunk in model_chunks:
                for group in getattr(chunk, "bucket_groups", []):
                    handle.patches.replace(group, "check_grads", check_grads_from_slots(group, handle.norms))
        for dist_opt in distributed_optimizers(optimizer):
            if handle.norms is not None:
                handle.patches.replace(dist_opt, "get_grad_norm", _norm_from_slots(handle, dist_opt))
            streamed = streamed_step_of(dist_opt)
            if not parts.staged or streamed is None:
                continue
            stage = StagedParams(streamed.offloader.streams)  # the state's side streams: one per link direction
            streamed.stage = stage
            handle.stages.append(stage)
            handle.staged_steps.append(streamed)
            # A skipped step (NaN, or a norm past the threshold) leaves no clipping for the next one.
            handle.patches.replace(dist_opt, "prepare_grads", _then_first(dist_opt.prepare_grads, stage.end_step))
            params = [param for group in dist_opt.optimizer.param_groups for param in group["params"]]
            handle.deferral = handle.deferral or ClipDeferral.install()
            handle.deferral.register(params, stage)
            handle.clipped_params += params
        staged = {id(step.offloader) for step in handle.staged_steps}
        if offload is not None and staged:
            handle.patches.replace(offload, "step_footprint", _footprint_with_stages(offload, staged))
    except BaseException:
        handle.detach()
        raise
    return handle


def _footprint_with_stages(offload: Any, staged: set[int]) -> Callable[[], int]:
    """``offload.step_footprint`` counting the stage's buffers of the offloaders (by ``id``) in ``staged``."""

    def step_footprint() -> int:
        return max((footprint(o, staged=id(o) in staged) for o in offload.offloaders), default=0)

    return step_footprint


def _then_first(method: Callable[..., Any], before: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before()
        return method(*args, **kwargs)

    return wrapper


def _norm_from_slots(handle: StreamedStepHandle, dist_opt: Any) -> Callable[[], Any]:
    original = dist_opt.get_grad_norm

    @functools.wraps(original)
    def get_grad_norm() -> Any:
        grads = dist_opt.get_grads_for_grad_norm()
        norms = handle.norms.norms_of(grads) if grads else None
        if norms is None:
            return original()  # a norm not taken in a slot: megatron-core's pass over the host gradients
        handle.slot_norm_steps += 1
        return norm_of_norms(norms, dist_opt.get_grad_stats_parallel_group())

    return get_grad_norm
