"""The order the streamed step updates chunks that are on the GPU at its start (``streamed_step.run``), on the CPU.

What it proves: kept chunks, on the GPU all along, are updated before the chunks that came back for this step
(whose copies may still be landing), in step order within each; the groups stay the same from step to step;
the values are those of the optimizer's own step.
"""

from __future__ import annotations

from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from tests.optimizer_state.cpu_engine import assert_same_training_state, many_masters, offloader_for, set_grads


def test_kept_chunks_are_updated_before_those_that_came_back() -> None:
    reference, _ = many_masters()
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, fraction=0.5)
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
        offloader.prefetch()  # what moves comes back ahead of the step
        seen.clear()
        with offloader.device_view.params_on_device():
            streamed_step.run(offloader, stepper, record)
        offloader.copies.drain()
        kept = {chunk.index for chunk in offloader.chunks if chunk.kept}
        if step == 0:
            continue  # the first step makes Adam's moments: the kept chunks come back through it
        order = [index for group in seen for index in group]
        assert kept and len(kept) < len(offloader.chunks)
        assert order[: len(kept)] == sorted(kept)  # kept first, in step order
        assert order[len(kept) :] == sorted(set(order) - kept)
        if step == 1:
            groups = [list(group) for group in seen]
        assert [list(group) for group in seen] == groups  # the same groups every step
    offloader.wait()
    assert_same_training_state(reference, optimizer)
