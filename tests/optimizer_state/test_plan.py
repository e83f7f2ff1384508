"""The plan as the state grows, on CPU tensors: moments that the first step creates join the plan (and,
chunked, their chunks) without a new plan or a new slab, params whose own tensor stays get their moments
planned, the state is walked again only when a tensor the plan rests on is new (or after a load), and state
that a later step makes for a param without any is planned and leaves; once torch's functional Adam updates
the state there is, no step looks for new state.
"""

from __future__ import annotations

import pytest
import torch

from megatron_offload.optimizer_state import plan, streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from tests.optimizer_state.cpu_engine import (
    adam_with_masters,
    aligned,
    assert_same_training_state,
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


def test_only_the_step_that_made_state_looks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Adam's first step runs the optimizer's own step (no state yet) and makes the moments, which the plan takes
    # in; later steps run torch's functional Adam over the state there is, and never walk the chunks for new state.
    reference, _ = many_masters()
    optimizer, masters = many_masters()
    for master in masters:
        master.requires_grad_(False)
    offloader = offloader_for(optimizer, masters, chunk_bytes=6000)
    offloader.offload()
    looked = []
    adopt = plan.adopt_new_state
    monkeypatch.setattr(
        plan, "adopt_new_state", lambda _plan, chunk, *rest: looked.append(chunk) or adopt(_plan, chunk, *rest)
    )
    for step in range(3):
        set_grads(optimizer, step)
        set_grads(reference, step)
        reference.step()
        looked.clear()
        run_step(offloader)
        assert len(looked) == (len(offloader.chunks) if step == 0 else 0)
    offloader.wait()
    assert_same_training_state(reference, optimizer)


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


def test_the_state_is_walked_again_only_when_a_tensor_it_rests_on_is_new(monkeypatch: pytest.MonkeyPatch) -> None:
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
    step()
    offloader.offload(now=False)
    assert len(walks) == 1  # nothing new since: the walk's answer stands

    def fail(params: list[torch.Tensor]) -> None:
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        step(fail)
    offloader.offload(now=False)
    assert len(walks) == 1  # a failed step made no tensor either
    offloader.wait()
    state = optimizer.state[masters[3]]
    state["exp_avg"] = state["exp_avg"].clone()  # put in the state's place by hand
    chunks = list(offloader.chunks)
    offloader.offload()
    assert len(walks) == 3  # the check found it, then the new plan
    assert in_host_slab(offloader, state["exp_avg"]) and offloader.chunks[0] is not chunks[0]
    offloader.state.replaced()  # a checkpoint load in between
    offloader.offload(now=False)
    assert len(walks) == 4  # a load is not trusted to identities: the plan is made again (the same one)
    step()
    assert len(walks) == 5  # the first check of that plan walks


def test_state_a_later_step_makes_is_planned_and_offloaded() -> None:
    optimizer, masters = many_masters()
    set_grads(optimizer, 0)
    masters[2].grad = None  # no gradient at the first step: Adam makes no state for it
    optimizer.step()
    assert not optimizer.state[masters[2]]
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    set_grads(optimizer, 1)
    run_step(offloader)  # the plan was current at the start: its moments join their chunk
    offloader.offload()
    assert all(in_host_slab(offloader, optimizer.state[masters[2]][key]) for key in ("exp_avg", "exp_avg_sq"))
    set_grads(optimizer, 2)
    offloader.wait()
    reference = [p.detach().clone() for p in masters]
    run_step(offloader)
    assert any(not torch.equal(p, r) for p, r in zip(masters, reference, strict=True))
