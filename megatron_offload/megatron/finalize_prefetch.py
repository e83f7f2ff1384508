"""State back once backward is done: each model config's ``finalize_model_grads_func`` is wrapped so that what did
not come back during backward (the default) or all of it (``--offload-prefetch finalize``) starts back as gradients
are finalized (``bring_back_for_step``, through the handle's ``backward_done``): its copies overlap the gradient
reduction, and the host issues them before megatron-core's gradient checks wait for the GPU, not between those checks
and the gradient norm. Loops without a finalize function start it as the step begins."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from megatron_offload.core.gpu_memory import allocated_bytes
from megatron_offload.core.streams import PREFETCH
from megatron_offload.megatron import pacing

__all__ = ["PrefetchOnFinalize", "bring_back_for_step", "unwrap_finalize_function", "wrap_finalize_functions"]


class Handle(pacing.Handle, Protocol):
    """What the wrapper needs of an OffloadHandle (which imports this module): the hooks' handle, the offloaders it
    wraps, and what it does once backward is done (``bring_back_for_step`` among it)."""

    offloaders: list
    on_cuda: bool

    def backward_done(self) -> None: ...


class PrefetchOnFinalize:
    """Wraps a TransformerConfig's ``finalize_model_grads_func``: tells the handle backward is done (it starts the
    copies back), then finalizes, so the copies overlap the gradient reduction. Keeps whatever function was there."""

    def __init__(self, inner: Callable[..., Any], handle: Handle) -> None:
        self.inner = inner
        self.handle = handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.handle.backward_done()
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
    for offloader in handle.offloaders:
        # All of it now: megatron-core's code until the step has no point of ours that would start them. First
        # what the backward's hooks queued (earlier in the step's order), then each new chunk as it is queued: the
        # link's way in starts with the first, not after the walk. Copies in only: a copy out started here would
        # hold megatron-core's next host read of a GPU value (one copy engine serves the copies out in order).
        offloader.copies.flush(PREFETCH)
    return handle.prefetch(max_bytes=room, now=True)


def wrap_finalize_functions(handle: Handle, model_chunks: Sequence[Any]) -> list[Any]:
    """(Re)wrap the finalize function of each of ``model_chunks``' configs for ``handle``; returns the configs
    wrapped now. Training loops often set it after the optimizer is built, so this runs again after every step;
    it never wraps twice. A chunk without a config (not a Megatron module) has none to wrap."""
    wrapped = []
    for chunk in model_chunks:
        model_config = getattr(chunk, "config", None)
        current = getattr(model_config, "finalize_model_grads_func", None)
        if current is None or isinstance(current, PrefetchOnFinalize):
            continue
        model_config.finalize_model_grads_func = PrefetchOnFinalize(current, handle)
        wrapped.append(model_config)
    return wrapped


def unwrap_finalize_function(model_config: Any) -> None:
    """Put back the function ``wrap_finalize_functions`` wrapped, if it is still ours."""
    if isinstance(model_config.finalize_model_grads_func, PrefetchOnFinalize):
        model_config.finalize_model_grads_func = model_config.finalize_model_grads_func.inner
