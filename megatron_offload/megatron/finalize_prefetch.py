"""State back once backward is done: ``--offload-prefetch finalize`` starts it when gradients are finalized, so
that its copy overlaps the gradient reduction, by wrapping each model config's ``finalize_model_grads_func``;
the default starts what did not come back during backward as the step begins (``bring_back_for_step``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from megatron_offload.core.gpu_memory import allocated_bytes
from megatron_offload.core.streams import PREFETCH
from megatron_offload.megatron import pacing
from megatron_offload.megatron.optimizer_internals import distributed_optimizers

__all__ = ["PrefetchOnFinalize", "bring_back_for_step", "unwrap_finalize_function", "wrap_finalize_functions"]


class Handle(pacing.Handle, Protocol):
    """What the wrapper needs of an OffloadHandle (which imports this module): the hooks' handle, and the
    optimizer and offloaders it wraps."""

    optimizer: Any
    offloaders: list
    on_cuda: bool


class PrefetchOnFinalize:
    """Wraps a TransformerConfig's ``finalize_model_grads_func``: starts the copy back, then finalizes,
    so the copy overlaps the gradient reduction. Keeps whatever function was there."""

    def __init__(self, inner: Callable[..., Any], handle: Handle) -> None:
        self.inner = inner
        self.handle = handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bring_back_for_step(self.handle)
        return self.inner(*args, **kwargs)


def bring_back_for_step(handle: Handle) -> int:
    """Backward is done (gradients finalized, or the step about to prepare them): start bringing back as much
    as the limit leaves beside what is allocated now and what the step will add (its buffers, kept state not
    back yet), every copy at once, so the link's way in carries state while megatron-core prepares the
    gradients and takes their norm; the rest streams through the step (under a tight cap the whole state does
    not fit at once). Nothing until what stays is decided: before, the peaks are read without state. Returns
    the bytes started."""
    if not handle.scheduler.decided:
        return 0
    room = None
    if handle.on_cuda:
        # The step will hold what is allocated now, its own buffers and the kept state not back yet (in the
        # iteration after the decision all of it: the step brings it back first, into blocks of its own).
        coming = sum(offloader.kept_to_come_back for offloader in handle.offloaders)
        room = max(0, handle.scheduler.backward_room(allocated_bytes() + handle.step_footprint() + coming))
    started = handle.prefetch(max_bytes=room)
    for offloader in handle.offloaders:
        # All of it now: megatron-core's code until the step has no point of ours that would start them.
        # Copies in only: a copy out started here would hold megatron-core's next host read of a GPU value
        # (one copy engine serves the device-to-host copies in order).
        offloader.copies.flush(PREFETCH)
    return started


def wrap_finalize_functions(handle: Handle) -> list[Any]:
    """(Re)wrap each model config's finalize function of ``handle``'s optimizer; returns the configs wrapped
    now. Training loops often set it after the optimizer is built, so this runs again after every step;
    it never wraps twice."""
    wrapped = []
    for dist_opt in distributed_optimizers(handle.optimizer):
        for chunk in dist_opt.model_chunks:
            model_config = chunk.config
            current = model_config.finalize_model_grads_func
            if current is None or isinstance(current, PrefetchOnFinalize):
                continue
            model_config.finalize_model_grads_func = PrefetchOnFinalize(current, handle)
            wrapped.append(model_config)
    return wrapped


def unwrap_finalize_function(model_config: Any) -> None:
    """Put back the function ``wrap_finalize_functions`` wrapped, if it is still ours."""
    if isinstance(model_config.finalize_model_grads_func, PrefetchOnFinalize):
        model_config.finalize_model_grads_func = model_config.finalize_model_grads_func.inner
