"""The order the streamed step updates chunks that are on the GPU at its start (``streamed_step.run``), on the CPU.

What it proves: chunks that leave after the step and have landed back already come first, the first of them
alone (their copies out then run beside the rest of the step, the first after one chunk's update), then the kept
chunks, on the GPU all along, then the chunks whose copies back are still on their way, each in step order; the
groups stay the same from step to step; the values are those of the optimizer's own step.
"""

from __future__ import annotations

import torch

from megatron_offload.core.streams import PREFETCH, HostStreams
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from tests.gates import Gate
from tests.optimizer_state.cpu_engine import adam_with_masters, assert_same_training_state, offloader_for, set_grads


class ArrivingStreams(HostStreams):
    """Copies back whose data is there at once but that count as landed only once their gate opens (a test
    opens it, or the compute stream waits for it), as a device's copies still on their way."""

    def __init__(self) -> None:
        self.gates: list[Gate] = []

    def copy(self, direction, pairs, after):
        began, done = super().copy(direction, pairs, after)
        if direction != PREFETCH:
            return began, done
        gate = Gate()
        self.gates.append(gate)
        return began, gate


def test_chunks_that_leave_and_landed_first_then_kept_then_arriving() -> None:
    torch.manual_seed(0)
    reference, _ = adam_with_masters((100,) * 12)
    torch.manual_seed(0)
    optimizer, masters = adam_with_masters((100,) * 12)
    streams = ArrivingStreams()
    offloader = offloader_for(optimizer, masters, chunk_bytes=1000, fraction=0.5, streams=streams)  # a chunk a param
    offloader.offload()
    stepper = ChunkStepper(optimizer)
    seen: list[list[int]] = []
    owner = {}

    def record(params) -> None:
        seen.append(sorted({owner[id(p)] for p in params}))

    for step in range(4):
        set_grads(reference, step)
        reference.step()
        set_grads(optimizer, step)
        owner = {id(p): chunk.index for chunk in offloader.chunks for p in chunk.params}
        moving = [chunk.index for chunk in offloader.chunks if not chunk.kept]
        early = offloader.chunks[moving[0]].nbytes + offloader.chunks[moving[1]].nbytes
        offloader.prefetch(max_bytes=early)  # the first two that leave come back and land (the last backward)
        for gate in streams.gates:
            gate.open = True
        offloader.copies.pump()
        offloader.prefetch()  # the rest is on its way as the step begins
        seen.clear()
        with offloader.device_view.params_on_device():
            streamed_step.run(offloader, stepper, record)
        offloader.copies.drain()
        streams.gates.clear()
        if step == 0:
            continue  # the first step makes Adam's moments: the kept chunks come back through it
        kept = sorted(chunk.index for chunk in offloader.chunks if chunk.kept)
        order = [index for group in seen for index in group]
        assert kept and len(moving) > 2
        assert order == moving[:2] + kept + moving[2:]  # landed leaving, kept, arriving: each in step order
        assert seen[0] == [moving[0]]  # the first leaving chunk alone: its copy out waits for one chunk's update
        if step == 1:
            groups = [list(group) for group in seen]
        assert [list(group) for group in seen] == groups  # the same groups every step
    offloader.wait()
    assert_same_training_state(reference, optimizer)
