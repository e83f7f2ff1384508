"""The optimizer step, streamed chunk by chunk through a few GPU buffers, both copy directions at once.

Chunks already on the GPU (kept, or prefetched during backward) are updated first, in groups, while
the first streamed chunks come in; the others stream through ``STAGING_CHUNKS`` buffers: prefetch chunk
i+2, update chunk i, offload chunk i-1, at once. The offloads of the chunks that were back early go
last, so the pipeline's own offloads, which free its buffers, have the link to the host to themselves.
Adam is element-wise, so stepping a subset of params per call gives bitwise the result of one call over
all of them (``RestrictedStep``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from megatron_offload import plan as planning
from megatron_offload.plan import Chunk
from megatron_offload.units import MIB

if TYPE_CHECKING:
    from megatron_offload.engine import OptimizerStateOffloader

__all__ = ["READY_GROUP_BYTES", "STAGING_CHUNKS", "RestrictedStep", "footprint", "run_streamed_step"]

# Buffers the streamed step cycles through: one chunk being prefetched, one updated, one offloaded.
STAGING_CHUNKS = 3
# Chunks already on the GPU at the step are updated in groups of about this size: one optimizer call
# each (few launches), while the optimizer's temporaries (a foreach Adam makes some the size of a
# moment) stay bounded instead of growing with all that came back early.
READY_GROUP_BYTES = 512 * MIB

AfterChunk = Callable[[list[torch.Tensor]], None]


class RestrictedStep:
    """Runs ``optimizer.step()`` over a subset of its params, once per chunk, as if it ran once.

    Every call sees the param-group settings as they were before the first call: apex's and
    TransformerEngine's FusedAdam count steps per group (``group["step"] += 1``), so without this a
    step cut into five chunks would count five steps. Per-element optimizers (every Adam) then give
    bitwise the same result as one call over all params.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[[], object] | None = None) -> None:
        self.optimizer = optimizer
        # The class's step: an instance attribute ``step`` may be a wrapper that calls us.
        self.step = step or functools.partial(type(optimizer).step, optimizer)
        self.settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]

    def __call__(self, params: Sequence[torch.Tensor]) -> None:
        wanted = {id(param) for param in params}
        groups = self.optimizer.param_groups
        every_param = [group["params"] for group in groups]
        try:
            for group, settings, group_params in zip(groups, self.settings, every_param, strict=True):
                for key in [key for key in group if key != "params" and key not in settings]:
                    del group[key]  # added by an earlier chunk's call, e.g. a first "step"
                group.update(settings)
                group["params"] = [param for param in group_params if id(param) in wanted]
            self.step()
        finally:
            for group, group_params in zip(groups, every_param, strict=True):
                group["params"] = group_params


def footprint(offloader: OptimizerStateOffloader) -> int:
    """Most device memory the streamed step adds beyond what is on the GPU already: the staging
    chunks, and optimizer temporaries for one group of ready chunks (counted at its full size)."""
    largest = max((max(c.nbytes, c.expected) for c in offloader.plan.chunks), default=offloader.chunk_bytes)
    return STAGING_CHUNKS * max(largest, offloader.chunk_bytes) + max(READY_GROUP_BYTES, offloader.chunk_bytes)


def _groups(chunks: list[Chunk], chunk_bytes: int) -> Iterator[list[Chunk]]:
    group: list[Chunk] = []
    for chunk in chunks:
        if group and sum(c.nbytes for c in group) + chunk.nbytes > max(READY_GROUP_BYTES, chunk_bytes):
            yield group
            group = []
        group.append(chunk)
    if group:
        yield group


@torch.no_grad()
def run_streamed_step(offloader: OptimizerStateOffloader, after_chunk: AfterChunk | None = None) -> None:
    """Run the optimizer step chunk by chunk and leave the state offloaded (offloads under way), kept
    chunks on the GPU. ``after_chunk(params)`` runs right after each chunk's update, while its state is
    on the GPU (Megatron copies the masters into the model there). State the optimizer creates on the
    way (Adam's moments, at its first step) joins its chunk and leaves with it. Falls back to one whole
    step when the plan no longer matches the state (after a load replaced tensors).

    The prefetch into a staging buffer is handed to its lane only after the offload of the chunk that
    used the buffer before has completed (a host wait), so no stream ever waits for another on the device.
    NOTE: stepping a subset of params per call gives bitwise the same result as one call only for
    optimizers that update each param from its own state and gradient (Adam, AdamW, SGD), not for those
    that mix params (LAMB's global norm).
    """
    offloader.check_lanes()
    offloader.check_gradients()
    stepper = RestrictedStep(offloader.optimizer)
    chunks = offloader.plan.chunks
    if offloader.plan.loose_masters or not chunks or offloader.plan.key != offloader._current_key():
        try:
            offloader.wait()
            params = planning.all_params(offloader.optimizer)
            stepper(params)
            if after_chunk is not None:
                after_chunk(params)
        finally:
            offloader.offload()
        return
    for chunk in chunks:
        if chunk.kept and chunk.offloaded:  # newly kept: into a block of its own, not a staging buffer
            offloader._prefetch_chunk(chunk)
    ready = [chunk for chunk in chunks if not chunk.offloaded]
    streamed = [chunk for chunk in chunks if chunk.offloaded]
    size = max((c.nbytes for c in streamed), default=0)
    staging = [offloader.new_block(size) for _ in range(min(STAGING_CHUNKS, len(streamed)))]
    fresh = offloader.compute_reached()  # the staging memory may have been freed by compute work just now
    offloader.stats.bytes_streamed += sum(chunk.nbytes for chunk in streamed)

    deferred: list[Chunk] = []  # chunks that were back before the step: offloaded after the streamed ones

    def update(group: list[Chunk], urgent: bool) -> None:
        for chunk in group:
            offloader.hand_to_compute(chunk)
        params = [p for chunk in group for p in chunk.params]
        stepper(params)
        if after_chunk is not None:
            after_chunk(params)
        for chunk in group:
            added = planning.adopt_new_state(
                offloader.plan, chunk, offloader.optimizer, offloader.keep_state_keys, offloader._slab.tensor
            )
            if added:
                offloader._count_plan()
            if chunk.kept:
                continue
            if urgent:
                offloader._offload_chunk(chunk, urgent=True)
            else:
                # The streamed chunks' offloads free the staging buffers the pipeline waits on: the
                # link to the host is theirs until the last one is out.
                deferred.append(chunk)

    try:
        for index, chunk in enumerate(streamed[: STAGING_CHUNKS - 1]):
            offloader._prefetch_chunk(chunk, staging[index][: chunk.nbytes], ready=fresh, urgent=True)
        for group in _groups(ready, offloader.chunk_bytes):
            update(group, urgent=False)
        for index, chunk in enumerate(streamed):
            update([chunk], urgent=True)  # the pipeline waits on its offload: ahead of the ready chunks
            upcoming = index + STAGING_CHUNKS - 1
            if upcoming < len(streamed):
                buffer = staging[upcoming % STAGING_CHUNKS]
                before = upcoming - STAGING_CHUNKS  # the chunk that used this buffer last
                if before >= 0 and streamed[before].offloading is not None:
                    # On the host: once its offload has read the buffer, the buffer may be overwritten.
                    streamed[before].offloading.synchronize()
                ready_at = fresh if before < 0 else None
                nbytes = streamed[upcoming].nbytes
                offloader._prefetch_chunk(streamed[upcoming], buffer[:nbytes], ready=ready_at, urgent=True)
    finally:
        # Updated chunks leave with their new values (those that were back before the step last);
        # chunks never handed to compute are dropped.
        for chunk in deferred:
            offloader._offload_chunk(chunk)
        for chunk in chunks:
            if not chunk.offloaded and not (chunk.kept and chunk.touched):
                offloader._offload_chunk(chunk)
        _settle_plan(offloader)
        offloader.count_step()


def _settle_plan(offloader: OptimizerStateOffloader) -> None:
    """After a step: adopt the current tensor set as the plan if every tensor in it is planned."""
    current = list(offloader._offloadable())
    if all(id(tensor) in offloader.plan.planned for tensor, _ in current):
        offloader.plan.key = planning.plan_key(current)
