"""The stage of the streamed step on the CPU: masters and gradients through buffers taken once per step,
copies on the side streams, ordered by events only.

What it proves: the step with a stage is bitwise the plain step (clipping deferred in or not); the next
group's copy in is queued before the current group's update; a buffer is refilled only after the copy out
that read it; the compute stream waits on events (never the host); every buffer is handed to both side
streams when freed; and the footprint counts the buffers a step takes.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_offload.core.streams import OFFLOAD, PREFETCH, HostStreams
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from megatron_offload.optimizer_state.staged_params import STAGED_BUFFERS, StagedParams, staged_bytes
from tests.gates import Gate
from tests.optimizer_state.cpu_engine import assert_same_training_state, many_masters, offloader_for, set_grads


class Log(HostStreams):
    """Copies done at once; every call written down; events that complete only when a test opens them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.blocks = 0

    def mark(self, timed: bool = False) -> Gate:
        gate = Gate()
        self.calls.append(("mark", gate))
        return gate

    def copy(self, direction, pairs, after):
        super().copy(direction, pairs, after)
        end = Gate()
        self.calls.append(("copy", direction, after, end))
        return None, end

    def compute_waits(self, event):
        self.calls.append(("wait", event))  # on the device: nothing on the host
        return None, None

    def block(self, nbytes: int) -> torch.Tensor:
        self.blocks += 1
        return super().block(nbytes)

    def keep_until_copied(self, tensor, direction) -> None:
        self.calls.append(("keep", direction, tensor.data_ptr()))


def staged_step(offloader, stepper: ChunkStepper, stage: StagedParams) -> None:
    """One streamed step with the stage, as the offload handle runs it; every copy landed after."""
    with offloader.device_view.params_on_device():
        try:
            streamed_step.run(offloader, stepper, stage=stage)
        finally:
            stage.end_step()
            offloader.copies.drain()


def clip_by(coefficient: float):
    def clip(params) -> None:
        for param in params:
            param.grad.mul_(coefficient)

    return clip


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])  # 0.0: every moment kept on the GPU, nothing moves
@pytest.mark.parametrize("clipped", [False, True])
def test_the_staged_step_is_the_plain_step_bitwise(fraction: float, clipped: bool) -> None:
    reference, _ = many_masters()
    offloaded, masters = many_masters()
    # The masters stay where they are (in host memory with weight streaming): only the moments are offloaded.
    offloader = offloader_for(offloaded, [], chunk_bytes=2000, fraction=fraction)
    offloader.offload()
    stage, stepper = StagedParams(HostStreams()), ChunkStepper(offloaded)
    for step in range(4):
        set_grads(reference, step)
        if clipped:
            clip_by(0.25)([p for g in reference.param_groups for p in g["params"]])
        reference.step()
        set_grads(offloaded, step)
        homes = [(p.data.data_ptr(), p.grad, p.grad.clone()) for p in masters]
        if clipped:
            stage.defer_clip(clip_by(0.25))
        staged_step(offloader, stepper, stage)
        for param, (data, grad, unclipped) in zip(masters, homes, strict=True):
            assert param.data_ptr() == data and param.grad is grad, "a param does not point at its host copy again"
            assert torch.equal(grad, unclipped), "the host gradient was written"
        assert stage.buffer_bytes == 0 and stage.clips == []
    offloader.wait()
    assert_same_training_state(reference, offloaded)
    # Masters and gradients cross once each way through the stage's buffers, with every moment kept too: an
    # update where they lie would cross the link in every pass of the optimizer.
    assert stage.bytes_in > 0 and stage.bytes_out > 0


def groups_of(params: list[torch.Tensor], count: int) -> list[list[torch.Tensor]]:
    size = -(-len(params) // count)
    return [params[i : i + size] for i in range(0, len(params), size)]


def test_copies_overlap_the_updates_and_are_ordered_by_events_only() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7, 3, 9, 4, 6, 2, 8, 5, 3)]
    for param in params:
        param.grad = torch.randn_like(param)
    groups = groups_of(params, 5)
    streams = Log()
    stage = StagedParams(streams)
    stage.begin(groups)
    assert streams.blocks == STAGED_BUFFERS, "the buffers are taken once, at the step's start"
    updates = []
    for group in groups:
        stage.lend(group)
        streams.calls.append(("update", group))
        for param in group:
            param.data.add_(param.grad)  # writes the GPU copy
        updates.append(len(streams.calls))
        stage.give_back()
    stage.end_step()
    calls = streams.calls
    ins = [c for c in calls if c[0] == "copy" and c[1] == PREFETCH]
    outs = [c for c in calls if c[0] == "copy" and c[1] == OFFLOAD]
    assert len(ins) == len(outs) == len(groups)
    position = {id(c): i for i, c in enumerate(calls)}
    at_update = [i for i, c in enumerate(calls) if c[0] == "update"]
    for index in range(len(groups) - 1):
        # group i+1 is queued in before group i's update: the copy runs while it computes
        assert position[id(ins[index + 1])] < at_update[index]
    fresh = calls[0][1]  # the compute mark taken at the step's start
    assert calls[0][0] == "mark"
    for index, copy_in in enumerate(ins):
        if index < STAGED_BUFFERS:  # a buffer's first fill: after the step's start mark
            assert copy_in[2] is fresh
        else:  # a buffer is refilled after the copy out that read it (three groups before), on the device
            assert copy_in[2] is outs[index - STAGED_BUFFERS][3]
    for index, copy_out in enumerate(outs):
        # after a compute mark taken after the group's update
        mark = calls[position[id(copy_out)] - 1]
        assert mark[0] == "mark" and copy_out[2] is mark[1] and position[id(copy_out)] > at_update[index]
    waits = [c[1] for c in calls if c[0] == "wait"]
    assert [w for w in waits if w is not outs[-1][3]] == [c[3] for c in ins], "the update waits for its copy in"
    assert waits[-1] is outs[-1][3], "the step ends ordered after the last copy out"
    kept = [(c[1], c[2]) for c in calls if c[0] == "keep"]
    assert len(kept) == 2 * STAGED_BUFFERS and {d for d, _ in kept} == {OFFLOAD, PREFETCH}
    assert not any(c[0] == "sync" for c in calls)


def test_a_group_out_of_order_is_staged_on_its_own() -> None:
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    for param in params:
        param.grad = torch.ones(4)
    stage = StagedParams(Log())
    stage.begin([[params[0]], [params[1]], [params[2]]])
    stage.lend([params[2]])  # not the first group: no buffer holds it yet
    params[2].data.mul_(3.0)
    stage.give_back()
    stage.end_step()
    assert torch.equal(params[2].data, torch.full((4,), 3.0)) and torch.equal(params[0].data, torch.ones(4))


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_footprint_counts_the_stage_buffers(fraction: float) -> None:
    _, masters = many_masters()
    offloaded = torch.optim.AdamW(masters, lr=1e-2)
    offloader = offloader_for(offloaded, [], chunk_bytes=2000, fraction=fraction)
    offloader.offload()
    plain = streamed_step.footprint(offloader)
    staged = streamed_step.footprint(offloader, staged=True)
    largest = max(staged_bytes(chunk.params, grads_known=False) for chunk in offloader.chunks)
    assert staged >= plain - streamed_step.READY_GROUP_BYTES // 2 + STAGED_BUFFERS * largest

    seen = []

    class Watching(StagedParams):
        def lend(self, params, copy=True) -> None:
            super().lend(params, copy)
            seen.append(self.buffer_bytes)

    stage, stepper = Watching(HostStreams()), ChunkStepper(offloaded)
    for step in range(3):
        set_grads(offloaded, step)
        staged_step(offloader, stepper, stage)
    assert seen and max(seen) <= streamed_step.staged_footprint(offloader)
    assert staged - streamed_step.staged_footprint(offloader) <= plain


def test_the_offload_handle_footprint_counts_the_stage_of_staged_offloaders_only() -> None:
    from megatron_offload.megatron.weights_step import _footprint_with_stages

    offloaders = []
    for chunk_bytes in (2000, 4000):
        _, masters = many_masters()
        offloader = offloader_for(torch.optim.AdamW(masters, lr=1e-2), [], chunk_bytes=chunk_bytes)
        offloader.offload()
        offloaders.append(offloader)
    handle = types.SimpleNamespace(offloaders=offloaders)
    plain = max(streamed_step.footprint(o) for o in offloaders)
    assert _footprint_with_stages(handle, set())() == plain
    unplanned = offloader_for(torch.optim.AdamW(many_masters()[1], lr=1e-2), [], chunk_bytes=3000)
    assert streamed_step.staged_footprint(unplanned) == STAGED_BUFFERS * 3000  # no chunks yet: a chunk a group
    with_stage = _footprint_with_stages(handle, {id(offloaders[0])})()
    assert with_stage == max(
        streamed_step.footprint(offloaders[0], staged=True), streamed_step.footprint(offloaders[1])
    )
    assert with_stage >= streamed_step.staged_footprint(offloaders[0])


def test_a_step_cut_short_leaves_every_param_at_its_host_copy_and_no_buffer() -> None:
    _, masters = many_masters()
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    offloader = offloader_for(optimizer, [], chunk_bytes=2000)
    offloader.offload()
    streams = Log()
    stage, stepper = StagedParams(streams), ChunkStepper(optimizer)
    set_grads(optimizer, 0)
    with offloader.device_view.params_on_device():
        streamed_step.run(offloader, stepper, stage=stage)  # the moments exist from here: chunks stream
        stage.end_step()
    offloader.copies.drain()
    calls = []

    def fail_on_second(params) -> None:
        calls.append(params)
        if len(calls) == 2:
            raise RuntimeError("boom")

    set_grads(optimizer, 1)
    homes = [(p.data_ptr(), p.grad) for p in masters]
    streams.calls.clear()
    with pytest.raises(RuntimeError, match="boom"), offloader.device_view.params_on_device():
        try:
            streamed_step.run(offloader, stepper, fail_on_second, stage=stage)
        finally:
            stage.end_step()
            offloader.copies.drain()
    for param, (data, grad) in zip(masters, homes, strict=True):
        assert param.data_ptr() == data and param.grad is grad
    kept = [c for c in streams.calls if c[0] == "keep"]
    assert stage.buffer_bytes == 0 and len(kept) == 2 * STAGED_BUFFERS  # every buffer handed to both side streams
