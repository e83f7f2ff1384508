"""Long context on a real megatron-core GPT (bf16, DDP + DistributedOptimizer, full recompute): the SDPA
layer spec against megatron-core's unfused local attention; layer inputs in host memory, with and without
streamed weights, and the chunked loss, each bitwise equal to the same settings without offloading."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests train a megatron-core GPT model", allow_module_level=True)

from megatron_offload import attach_offloader  # noqa: E402
from megatron_offload.core.mapped_memory import MappedPool  # noqa: E402
from megatron_offload.megatron.long_context_adapter import (  # noqa: E402
    LongContextHandle,
    attach_chunked_loss,
    attach_layer_input_offloader,
)
from megatron_offload.megatron.sdpa_spec import sdpa_layer_spec  # noqa: E402
from megatron_offload.megatron.weights_adapter import attach_weight_streamer, move_buffers_to_gpu  # noqa: E402
from tests.gpu.harness import GPTShape, build_gpt_training, init_distributed  # noqa: E402
from tests.gpu.parity import assert_bitwise_equal, snapshot, train  # noqa: E402

SHAPE = GPTShape(num_layers=4, seq_length=1024, micro_batch_size=1, num_micro_batches=2)
STEPS = 5
CHUNK = 256  # tokens per loss chunk: four chunks per micro-batch


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    init_distributed()


@pytest.fixture(autouse=True)
def deterministic():
    """The flash backend's backward adds the query gradient up with atomics unless PyTorch is asked for
    determinism (as Megatron's --deterministic-mode asks): bitwise comparisons need it on both sides."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as Megatron's --deterministic-mode sets it
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def build(chunked: bool = False, layer_inputs: bool = False, spec: bool = True, **kwargs):
    layer_spec = sdpa_layer_spec() if spec else None
    training = build_gpt_training(SHAPE, recompute=True, layer_spec=layer_spec, **kwargs)
    handle = LongContextHandle()
    if layer_inputs:
        attach_layer_input_offloader(training.model, handle)
    if chunked:
        attach_chunked_loss(training.model, handle, CHUNK)
    return training, handle


@pytest.fixture(scope="module")
def reference() -> tuple[list, dict]:
    """SDPA spec, chunked loss, full recompute, nothing offloaded."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    training, _ = build(chunked=True)
    return train(training, STEPS), snapshot(training)


def test_sdpa_spec_trains_like_the_local_attention() -> None:
    """20 steps from the same initial weights. Step 1 differs only by the forward's rounding: the local
    attention rounds scores and probabilities to bf16 before the value product, the fused kernels keep
    them in fp32 (a relative 1e-3 bounds what bf16's 8-bit mantissa allows over a 4-layer stack). After
    that the runs drift apart as two bf16 trainings with different rounding do: within 2% of the loss."""
    torch.use_deterministic_algorithms(False)
    local, _ = build(spec=False)
    sdpa, _ = build(spec=True)
    local_losses = [loss for loss, _ in train(local, 20)]
    sdpa_losses = [loss for loss, _ in train(sdpa, 20)]
    assert abs(sdpa_losses[0] - local_losses[0]) <= 1e-3 * local_losses[0], (sdpa_losses[0], local_losses[0])
    worst = max(abs(a - b) / b for a, b in zip(sdpa_losses, local_losses, strict=True))
    assert worst <= 0.02, (worst, sdpa_losses, local_losses)
    assert sdpa_losses[-1] < sdpa_losses[0] - 0.5, "the SDPA model did not learn"
    attention = [m for m in sdpa.model[0].modules() if type(m).__name__ == "SDPAttention"]
    assert len(attention) == SHAPE.num_layers
    print(f"SDPA backend: {attention[0].backend}")
    assert attention[0].backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"), attention[0].backend


def test_sdpa_attention_memory_grows_with_the_sequence_not_its_square() -> None:
    torch.use_deterministic_algorithms(False)
    peaks = {}
    for spec in (False, True):
        training, _ = build(spec=spec)
        modules = training.model[0].modules()
        attention = next(m for m in modules if "Attention" in type(m).__name__ and hasattr(m, "softmax_scale"))
        s, heads, dim = 8192, SHAPE.num_attention_heads, SHAPE.hidden_size // SHAPE.num_attention_heads
        q, k, v = (
            torch.randn(s, 1, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attention(q, k, v, None).float().sum().backward()
        torch.cuda.synchronize()
        peaks[spec] = torch.cuda.max_memory_allocated() - base
    scores = heads * 8192 * 8192 * 2  # one bf16 [heads, s, s] tensor
    assert peaks[False] >= scores, peaks
    assert peaks[True] < scores / 8, peaks


def test_chunked_loss_is_close_to_the_full_logits_loss() -> None:
    torch.use_deterministic_algorithms(False)
    plain, _ = build(chunked=False)
    chunked, _ = build(chunked=True)
    plain_losses = [loss for loss, _ in train(plain, 3)]
    chunked_losses = [loss for loss, _ in train(chunked, 3)]
    # The same fp32 log-sum-exp over the same bf16 logits, a different summation order: close, not equal.
    pairs = zip(chunked_losses, plain_losses, strict=True)
    assert all(abs(a - b) <= 2e-3 * b for a, b in pairs), (chunked_losses, plain_losses)


def test_layer_inputs_offloaded_train_bitwise_like_kept(reference) -> None:
    expected_results, expected = reference
    training, handle = build(chunked=True, layer_inputs=True)
    assert train(training, STEPS) == expected_results
    assert_bitwise_equal(expected, snapshot(training))
    stats = handle.layer_inputs.read_stats()
    per_pass = SHAPE.num_layers - 1  # the pass's last input stays
    assert stats.sent == stats.fetched == STEPS * SHAPE.num_micro_batches * per_pass
    one = SHAPE.seq_length * SHAPE.micro_batch_size * SHAPE.hidden_size * 2
    assert stats.host_bytes == per_pass * one
    handle.detach()


def test_with_weights_and_state_streamed_bitwise_and_through_a_save_and_resume(reference, tmp_path) -> None:
    """Weights streamed, state offloaded, layer inputs offloaded, chunked loss: equal to the reference;
    saved (torch_dist) after 2 steps and resumed into a run of another seed, bitwise too."""
    from tests.gpu.test_checkpoint import load_checkpoint, save_checkpoint

    expected_results, expected = reference
    pool = MappedPool()

    def streamed(seed: int):
        with pool.allocating():
            training = build_gpt_training(SHAPE, seed=seed, recompute=True, layer_spec=sdpa_layer_spec())
        move_buffers_to_gpu(training.model)
        weights = attach_weight_streamer(training.model)
        handle = LongContextHandle()
        attach_layer_input_offloader(training.model, handle)
        attach_chunked_loss(training.model, handle, CHUNK)
        state = attach_offloader(training.optimizer, offload_master_weights=False)
        return training, weights, handle, state

    saving, weights, handle, state = streamed(1234)
    assert train(saving, 2) == expected_results[:2]
    save_checkpoint(saving, str(tmp_path))
    assert [saving.train_step(i) for i in range(2, STEPS)] == expected_results[2:]
    state.detach()
    assert_bitwise_equal(expected, snapshot(saving))
    assert handle.layer_inputs.read_stats().sent > 0
    weights.detach()
    handle.detach()

    resumed, weights, handle, state = streamed(4321)
    for iteration in (100, 101):  # torch Adam's state must exist before a load can be planned
        resumed.train_step(iteration)
    load_checkpoint(resumed, str(tmp_path))
    assert [resumed.train_step(i) for i in range(2, STEPS)] == expected_results[2:]
    state.detach()
    assert_bitwise_equal(expected, snapshot(resumed))
    weights.detach()
    handle.detach()
