"""The optimizer step, chunk by chunk, streaming what is not back yet through a few GPU buffers.

Chunks on the GPU are updated first, in groups (those that leave before those kept, the first alone), while the
first streamed chunks come in; their copies out start within the step (``ShareOut``: between the streamed chunks',
all at once when nothing streams), but for the bytes left to the loop's next points. The others stream through at most
``STAGING_CHUNKS`` buffers as large as the largest of them, one after another as through a ring (``staging_ring``):
copies in ahead, one chunk updated, copies out behind, at once, every order kept on the device: no host waits.
NOTE: a streamed chunk's copy out starts within the step (its buffer is needed again).
NOTE: with a ``stage`` (params whose values and gradients live in device-mapped host memory), each group's params
and gradients come to the GPU ahead of its update (the stage is told the order first), and ready chunks are updated
in groups of about one chunk (each group's GPU copies are that large), also when the whole state is kept on the
GPU; only the fallback whole step (after a load replaced tensors) updates them where they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_offload.core.streams import PREFETCH
from megatron_offload.core.units import MIB
from megatron_offload.optimizer_state import plan as planning
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from megatron_offload.optimizer_state.plan import Chunk
from megatron_offload.optimizer_state.share_out import ShareOut
from megatron_offload.optimizer_state.staged_params import STAGED_BUFFERS, staged_bytes
from megatron_offload.optimizer_state.staging_ring import Staging

if TYPE_CHECKING:
    from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader

__all__ = ["READY_GROUP_BYTES", "STAGING_CHUNKS", "begin_staging", "footprint", "run", "staged_footprint"]

# Most buffers the streamed step cycles through: one chunk coming in, one updated, one going out.
STAGING_CHUNKS = 3
# Chunks already on the GPU at the step are updated in groups of about this size: few launches,
# while the optimizer's temporaries (a foreach Adam makes some the size of a moment: a third of a
# group of masters and moments; counted as half) stay bounded.
READY_GROUP_BYTES = 1024 * MIB

AfterChunk = Callable[[list[torch.Tensor]], None]


class Stage(Protocol):
    """Brings a chunk's params and gradients to the GPU around its update (``staged_params.StagedParams``)."""

    def begin(self, order: list[list[torch.Tensor]]) -> None: ...

    def lend(self, params: list[torch.Tensor], copy: bool = True) -> None: ...

    def give_back(self) -> None: ...

    def end_step(self) -> None: ...


def footprint(offloader: OptimizerStateOffloader, staged: bool = False) -> int:
    """Most device memory the streamed step adds beyond what is on the GPU already: three staging buffers (where
    ``Staging`` takes two, the third's room is slack the allocator uses near the limit: counted as two, the last
    backward brought a GiB more back, the allocator retried more often and one run in seven ran out of memory
    under a 90% cap), and optimizer temporaries for one group of ready chunks. ``staged``: also the stage's buffers
    (``STAGED_BUFFERS`` of the largest group's params and gradients) and temporaries for a group of one chunk."""
    largest = max((_size(c) for c in offloader.chunks), default=offloader.chunk_bytes)
    chunk_bytes = max(largest, offloader.chunk_bytes)
    if not staged:
        return STAGING_CHUNKS * chunk_bytes + max(READY_GROUP_BYTES, offloader.chunk_bytes) // 2
    return STAGING_CHUNKS * chunk_bytes + chunk_bytes // 2 + staged_footprint(offloader)


def staged_footprint(offloader: OptimizerStateOffloader) -> int:
    """The stage's buffers: ``STAGED_BUFFERS`` of the most a group holds, one chunk's params and gradients,
    or chunks whose state adds up to ``chunk_bytes`` at most (bounded by the highest ratio of staged bytes
    to state bytes among them). Before a plan: ``chunk_bytes`` a group (fp32 masters and gradients take
    8 bytes per parameter, as Adam's moments do)."""
    if not offloader.chunks:
        return STAGED_BUFFERS * offloader.chunk_bytes
    single, ratio = 0, 0.0
    for chunk in offloader.chunks:
        staged = staged_bytes(chunk.params, grads_known=False)
        single = max(single, staged)
        ratio = max(ratio, staged / max(_size(chunk), 1))
    return STAGED_BUFFERS * max(single, int(ratio * offloader.chunk_bytes) + 1 if ratio else 0)


def _size(chunk: Chunk) -> int:
    return max(chunk.nbytes, chunk.expected)


def _groups(chunks: list[Chunk], group_bytes: int) -> Iterator[list[Chunk]]:
    group: list[Chunk] = []
    for chunk in chunks:
        if group and sum(_size(c) for c in group) + _size(chunk) > group_bytes:
            yield group
            group = []
        group.append(chunk)
    if group:
        yield group


def _can_stream(off: OptimizerStateOffloader) -> bool:
    """The plan is the state's (one walk over it), so the step can stream; else it is one whole step."""
    return not off.plan.loose_masters and bool(off.chunks) and off.plan_is_current()


def begin_staging(off: OptimizerStateOffloader) -> Staging | None:
    """As the optimizer's step begins, where the step will stream: ``_take_staging`` and start the copies in as
    far as the buffers allow, to run beside megatron-core's own work ahead of the update (gradient checks, norm,
    clipping), which touches no optimizer state. ``run`` takes it over; None where the step will not stream."""
    if not _can_stream(off):
        return None
    staging = _take_staging(off)
    staging.bring_in_due()
    return staging


def _take_staging(off: OptimizerStateOffloader) -> Staging:
    """Queue newly kept chunks back into blocks of their own and take the staging buffers for the rest (those
    neither on the GPU nor coming back), the largest first: megatron-core reads a scalar right after the step,
    and that read waits behind every device-to-host copy queued before it, so the step ends on small ones."""
    for chunk in off.chunks:
        if chunk.kept and not chunk.on_gpu and chunk.copy is None:
            off.queue_prefetch(chunk)  # newly kept: into a block of its own, not a staging buffer
    streamed = [chunk for chunk in off.chunks if not (chunk.on_gpu or chunk.copy is not None)]
    streamed.sort(key=lambda chunk: -chunk.nbytes)  # stable: chunks of one size stay in step order
    return Staging(off, streamed, STAGING_CHUNKS)


@torch.no_grad()
def run(
    off: OptimizerStateOffloader,
    stepper: ChunkStepper,
    after_chunk: AfterChunk | None = None,
    stage: Stage | None = None,
    forward_hides: int = 0,
    staging: Staging | None = None,
) -> None:
    """Run the optimizer step chunk by chunk and leave the state leaving (kept chunks on the GPU).
    ``after_chunk(params)`` runs right after each chunk's update, while its state is on the GPU
    (Megatron copies the masters into the model there). State the optimizer creates on the way (Adam's
    moments, at its first step) joins its chunk and leaves with it. Falls back to one whole step when
    the plan does not match the state (after a load replaced tensors). ``stage``: see the NOTE above.
    ``forward_hides``: bytes of the ready chunks' copies out left queued for the next forward (``ShareOut``);
    ``staging``: what ``begin_staging`` started as the optimizer's step began (made here otherwise)."""
    off.copies.pump()  # a failed copy is named here, before anything is updated
    off.device_view.check_gradients()
    stepper.begin()
    if stepper.plan is not off.plan:
        stepper.forget(off.plan)
    begun = staging is not None and staging.plan is off.plan  # the plan was checked as the step began
    if not begun and not _can_stream(off):
        try:
            off.wait()
            params = planning.all_params(off.optimizer)
            _whole_step(stepper, params, after_chunk, stage)
        finally:
            off.offload(now=False)  # a new plan for the state as it is now, then out
        return
    chunks = off.chunks
    here = all(chunk.kept and chunk.on_gpu and chunk.copy is None and chunk.ready is None for chunk in chunks)
    if here and stage is None:
        # Nothing moves (all of it kept and here): the optimizer's own step, as without offloading. With a
        # stage the groups below still run: its params and gradients lie in host memory, where the
        # optimizer's own step would cross the link in each of its passes.
        _whole_step(stepper, planning.all_params(off.optimizer), after_chunk, None)
        for chunk in chunks:
            chunk.touched = True
        return
    if staging is None or not begun:
        staging = _take_staging(off)  # its copies start below, after the stage has been told the order
    streamed = staging.streamed
    coming_in = {id(chunk) for chunk in streamed}
    ready = [c for c in chunks if (c.on_gpu or c.copy is not None) and id(c) not in coming_in]  # here or coming

    def update(group: list[Chunk]) -> bool:
        """Update the group's chunks; True when the optimizer made new state (its first step)."""
        for chunk in group:
            off.hand_to_compute(chunk)
        params = [p for chunk in group for p in chunk.params]
        if stage is not None:
            stage.lend(params)
        try:
            made = stepper(params, key=tuple(chunk.index for chunk in group))
            if after_chunk is not None:
                after_chunk(params)
        finally:
            if stage is not None:
                stage.give_back()
        if not made:  # only the optimizer's own step makes state, not torch's functional Adam: no walk per chunk
            return False
        added = [planning.adopt_new_state(off.plan, c, off.optimizer, off.keep_state_keys, off.slab) for c in group]
        if any(added):
            off.count_plan()
        return any(added)

    group_bytes = off.chunk_bytes if stage is not None else max(READY_GROUP_BYTES, off.chunk_bytes)
    # Leaving chunks that landed first, the first alone (the way out starts after one chunk's update), then the kept
    # ones (nothing to wait for while the others still come in), last those still on their way.
    leaving = [c for c in ready if not c.kept and c.on_gpu and c.copy is None and c.ready is None]
    settled = [chunk for chunk in ready if chunk.kept and chunk.on_gpu and chunk.copy is None]
    first = {id(chunk) for chunk in leaving + settled}
    arriving = [chunk for chunk in ready if id(chunk) not in first]
    ready_groups = [leaving[:1]] if leaving else []
    ready_groups += [group for part in (leaving[1:], settled, arriving) for group in _groups(part, group_bytes)]
    try:
        if stage is not None:  # the update order: the stage brings each group's params in ahead of it
            stage.begin([[p for c in group for p in c.params] for group in [*ready_groups, *([c] for c in streamed)]])
        staging.bring_in_due()
        moving = sum(chunk.nbytes for chunk in ready if not chunk.kept)
        coming = max(0, off.copies.pending_bytes(PREFETCH) - staging.queued_behind_first())
        streamed_bytes = sum(chunk.nbytes for chunk in streamed)
        beside = ShareOut(off.copies, moving, coming, streamed_bytes, forward_hides)
        for group in ready_groups:
            update(group)
            for chunk in group:
                if not chunk.kept:
                    beside.add(off.queue_offload(chunk))
        for chunk in streamed:
            created = update([chunk])
            out = off.queue_offload(chunk, now=True)  # its bytes are needed again: out at once
            beside.streamed_out(chunk)
            excess = off.leaving_bytes - len(staging.buffers) * staging.size
            if created and excess > 0:
                # Adam's first step makes the moments in memory of their own, faster than they can leave:
                # on the host, once, wait for the oldest to land, so that step holds a few chunks too.
                off.copies.drain(excess)
            staging.left(out.done if out is not None else None)
    finally:
        off.queue_out()  # whatever is still here and not kept leaves, never half-way (the plan was checked above)
        off.count_step()
        off.copies.pump()


def _whole_step(step: ChunkStepper, params: list[torch.Tensor], after: AfterChunk | None, stage: Stage | None) -> None:
    """One update of every param where it is (a stage only applies what it defers, e.g. clipping)."""
    if stage is not None:
        stage.lend(params, copy=False)
    try:
        step.restricted(params)
        if after is not None:
            after(params)
    finally:
        if stage is not None:
            stage.give_back()
