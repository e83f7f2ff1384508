"""The optimizer step of weight streaming as one streamed pass, on a real megatron-core GPT: gradient
zeroing left out, the gradient norm and NaN check from the slots, masters and gradients staged per chunk
with clipping inside it. Losses, model params, masters and Adam moments bitwise equal to no offload,
with clipping on (coefficient below 1 at this learning rate) and off, and each part alone. The staged
part's masters and gradients move on the offloader's side streams through buffers freed after each step."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests train a megatron-core GPT model", allow_module_level=True)

from megatron_offload import attach_offloader  # noqa: E402
from megatron_offload.core.mapped_memory import MappedPool  # noqa: E402
from megatron_offload.megatron.weights_adapter import attach_weight_streamer, move_buffers_to_gpu  # noqa: E402
from megatron_offload.megatron.weights_step import StepParts, attach_streamed_step  # noqa: E402
from megatron_offload.optimizer_state import streamed_step  # noqa: E402
from tests.gpu.harness import GPTShape, build_gpt_training, init_distributed  # noqa: E402
from tests.gpu.parity import assert_bitwise_equal, snapshot, train  # noqa: E402

SHAPE = GPTShape(num_layers=6, num_micro_batches=3)
STEPS = 5
PARTS = {
    "all": StepParts(),
    "norms only": StepParts(skip_zeroing=False, staged=False),
    "staged only": StepParts(skip_zeroing=False, norms=False),
    "zeroing only": StepParts(norms=False, staged=False),
}


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    init_distributed()


@pytest.fixture(scope="module")
def pool() -> MappedPool:
    return MappedPool()


@pytest.fixture(scope="module", params=[1.0, 0.0], ids=["clip", "no-clip"])
def reference(request) -> tuple[float, list, dict]:
    training = build_gpt_training(SHAPE, recompute=True, clip_grad=request.param)
    results = train(training, STEPS)
    return request.param, results, snapshot(training)


@pytest.mark.parametrize("parts", list(PARTS), ids=list(PARTS))
@pytest.mark.parametrize("prefetch", ["auto", "step"])
def test_streamed_step_is_bitwise_megatron_cores(reference, pool: MappedPool, parts: str, prefetch: str) -> None:
    clip_grad, expected_results, expected = reference
    with pool.allocating():
        training = build_gpt_training(SHAPE, recompute=True, clip_grad=clip_grad)
    move_buffers_to_gpu(training.model)
    weights = attach_weight_streamer(training.model)
    state = attach_offloader(training.optimizer, offload_master_weights=False, prefetch=prefetch)
    plain_footprint = state.step_footprint()
    step = attach_streamed_step(training.optimizer, weights, training.model, PARTS[parts], offload=state)
    if PARTS[parts].staged:  # the stage's buffers count against a cap
        assert state.step_footprint() >= streamed_step.staged_footprint(state.offloaders[0]) > 0
        assert step.stages[0].streams is state.offloaders[0].streams  # the copies run on the side streams
    results = train(training, STEPS)
    assert [loss for loss, _ in results] == [loss for loss, _ in expected_results]
    if PARTS[parts].norms:
        assert step.slot_norm_steps == STEPS, "the gradient norm was not taken from the slots"
    if PARTS[parts].staged:
        stage = step.stages[0]
        assert stage.bytes_in > 0 and stage.bytes_out > 0
        assert stage.buffer_bytes == 0, "the stage's buffers outlived the step"
    step.detach()
    assert state.step_footprint() == plain_footprint
    state.detach()
    assert_bitwise_equal(expected, snapshot(training))
    weights.detach()
