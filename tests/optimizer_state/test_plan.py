"""The plan as the state grows, on CPU tensors: moments that the first step creates join the plan (and,
chunked, their chunks) without a new plan or a new slab, params whose own tensor stays get their moments
planned, and the offload right after a whole streamed step trusts the step's check of the plan.
"""

from __future__ import annotations

import pytest
import torch

from megatron_offload.optimizer_state import plan, streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from tests.optimizer_state.cpu_engine import (
    adam_with_masters,
    aligned,
    in_host_slab,
    many_masters,
    offloader_for,
    run_step,
    set_grads,
    take_step,
)


def test_moments_created_at_the_first_step_join_the_plan() -> None:
    optimizer, masters = adam_with_masters()
    offloader = offloader_for(optimizer, masters)
    offloader.offload()  # before the first step: only the masters exist
    masters_only = offloader.stats.host_bytes
    assert masters_only == sum(aligned(m.numel() * 4) for m in masters)
    slab = offloader.state.host_slab
    assert slab.nbytes == 3 * masters_only  # sized for the moments to come: pinned once
    offloader.wait()
    take_step(optimizer, 0)
    offloader.offload()
    assert offloader.stats.host_bytes == 3 * masters_only
    assert offloader.state.host_slab is slab
    assert in_host_slab(offloader, optimizer.state[masters[0]]["exp_avg_sq"])


def test_adam_first_moments_join_their_chunks_without_a_new_plan() -> None:
    optimizer, masters = many_masters()
    for master in masters:
        master.requires_grad_(False)  # as Megatron's masters: Adam steps them, their grads set by hand
    offloader = offloader_for(optimizer, masters, chunk_bytes=6000)
    offloader.offload()  # at attach: only the masters exist
    chunks, slab = list(offloader.chunks), offloader.state.host_slab
    set_grads(optimizer, 0)
    run_step(offloader)  # Adam's first step creates the moments chunk by chunk
    assert offloader.chunks == chunks and offloader.state.host_slab is slab  # same plan, same pinned slab
    assert all(in_host_slab(offloader, optimizer.state[p][key]) for p in masters for key in ("exp_avg", "exp_avg_sq"))
    assert offloader.stats.host_bytes == sum(3 * aligned(m.numel() * 4) for m in masters)
    assert all(len(chunk.entries) == 3 * len(chunk.params) for chunk in chunks)


@pytest.mark.parametrize("offloaded_masters", [slice(0, 3), slice(0, 0)])
def test_params_without_an_offloaded_master_get_their_moments_planned(offloaded_masters: slice) -> None:
    # Megatron's fp32 params (and every param under --no-offload-master-weights) are optimizer params
    # whose own tensor stays put; only the moments their first step creates leave.
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters[offloaded_masters], chunk_bytes=6000)
    offloader.offload()
    chunks = list(offloader.chunks)
    set_grads(optimizer, 0)
    run_step(offloader)
    assert offloader.chunks == chunks  # no new plan, so nothing came back whole
    assert all(in_host_slab(offloader, optimizer.state[p]["exp_avg_sq"]) for p in masters)
    assert [in_host_slab(offloader, p) for p in masters] == [i in range(7)[offloaded_masters] for i in range(7)]
    assert offloader.stats.offloads == (2 if offloaded_masters.stop else 1)


def test_the_offload_right_after_a_whole_streamed_step_needs_no_second_walk_over_the_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    walks = []
    walk = plan.offloadable_tensors
    monkeypatch.setattr(plan, "offloadable_tensors", lambda *args: walks.append(args) or walk(*args))

    def step(after_chunk=None) -> None:
        set_grads(optimizer, len(walks))
        streamed_step.run(offloader, ChunkStepper(optimizer), after_chunk)

    step()
    assert len(walks) == 1  # the step's own check
    offloader.offload(now=False)
    assert len(walks) == 1  # the step vouched for the plan
    offloader.offload(now=False)
    assert len(walks) == 2  # for one call only
    step()
    step()
    assert len(walks) == 4  # each step checks for itself, vouched for or not
    offloader.state.replaced()  # a checkpoint load in between
    offloader.offload(now=False)
    assert len(walks) == 6  # the check, then the new plan

    def fail(params: list[torch.Tensor]) -> None:
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        step(fail)
    offloader.offload(now=False)
    assert len(walks) == 8  # a step that failed half-way vouches for nothing
