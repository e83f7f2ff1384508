"""``--offload-prefetch finalize``: the state starts back when gradients are finalized, so that its copy
overlaps the gradient reduction, by wrapping each model config's ``finalize_model_grads_func``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from megatron_offload.megatron import pacing
from megatron_offload.megatron.optimizer_internals import distributed_optimizers

__all__ = ["PrefetchOnFinalize", "wrap_finalize_functions"]


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
        handle = self.handle
        if handle.scheduler.decided:  # before, the peaks are read without state: nothing back early
            # As much as the limit leaves beside what is allocated now and what the step will add; the
            # rest streams through the step (under a tight cap the whole state does not fit at once).
            allocated = torch.cuda.memory_allocated() if handle.on_cuda else 0
            room = handle.scheduler.backward_room(allocated + handle.step_footprint())
            handle.prefetch(max_bytes=max(0, room) if handle.on_cuda else None)
            for offloader in handle.offloaders:
                offloader.copies.flush()  # all of it now: no read of the host waits behind copies back
        return self.inner(*args, **kwargs)


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
