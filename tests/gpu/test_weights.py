"""Weight streaming on a real megatron-core GPT (local spec, bf16, DDP + DistributedOptimizer, full
recompute one layer at a time): built in device-mapped host memory, layers streamed through GPU slots,
optimizer state offloaded; bitwise equal to the same model trained without any of it."""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests train a megatron-core GPT model", allow_module_level=True)

from megatron_offload import attach_offloader  # noqa: E402
from megatron_offload.core.gpu_memory import gpu_only  # noqa: E402
from megatron_offload.core.mapped_memory import MappedPool, mapped_allocated_bytes  # noqa: E402
from megatron_offload.megatron.weights_adapter import attach_weight_streamer, move_buffers_to_gpu  # noqa: E402
from tests.gpu.harness import GPTShape, build_gpt_training, init_distributed  # noqa: E402
from tests.gpu.parity import assert_bitwise_equal, snapshot, train  # noqa: E402

SHAPE = GPTShape(num_layers=6, num_micro_batches=3)
STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    init_distributed()


@pytest.fixture(scope="module")
def reference() -> tuple[list, dict]:
    training = build_gpt_training(SHAPE, recompute=True)
    results = train(training, STEPS)
    return results, snapshot(training)


@pytest.fixture(scope="module")
def pool() -> MappedPool:
    return MappedPool()


def streamed_training(
    pool: MappedPool, layer_major: bool = False, seed: int = 1234, weight_slots: int = 3, **offload: object
):
    # Held by live tensors, not mapped: the pool reuses what an earlier run of this module freed. That run's
    # garbage is collected first: freed during the build, it would hide what the build allocated.
    gc.collect()
    before = mapped_allocated_bytes()
    with pool.allocating():
        training = build_gpt_training(SHAPE, seed=seed, recompute=True, no_sync=layer_major)
    assert mapped_allocated_bytes() > before, "the model was not built in host memory"
    move_buffers_to_gpu(training.model)
    handle = attach_weight_streamer(training.model, weight_slots=weight_slots, layer_major=layer_major)
    state = attach_offloader(training.optimizer, offload_master_weights=False, **offload)
    return training, handle, state


@pytest.mark.parametrize("prefetch", ["auto", "step"])
def test_streamed_weights_train_bitwise_like_no_offload(reference, pool: MappedPool, prefetch: str) -> None:
    expected_results, expected = reference
    training, handle, state = streamed_training(pool, prefetch=prefetch)
    results = train(training, STEPS)
    assert [loss for loss, _ in results] == [loss for loss, _ in expected_results]
    state.detach()  # the Adam state back on the GPU, where the reference keeps it
    assert_bitwise_equal(expected, snapshot(training))
    stats = handle.read_stats()
    layer_bytes = handle.streamer.layers[0].nbytes
    # every step brings each layer in at least once for its forward
    assert stats.bytes_in >= STEPS * SHAPE.num_micro_batches * SHAPE.num_layers * layer_bytes
    assert stats.bytes_out > 0
    handle.detach()


@pytest.mark.parametrize("weight_slots", [3, SHAPE.num_layers])
def test_layer_major_backward_trains_bitwise_and_each_layer_leaves_once_a_step(
    reference, pool: MappedPool, weight_slots: int
) -> None:
    """In layer order each layer's gradients leave once a step; with a weight slot per layer, each layer also
    comes in once a step."""
    from megatron.core import tensor_parallel

    original = tensor_parallel.checkpoint
    expected_results, expected = reference
    training, handle, state = streamed_training(pool, layer_major=True, weight_slots=weight_slots)
    assert tensor_parallel.checkpoint is not original
    results = train(training, STEPS)
    assert [loss for loss, _ in results] == [loss for loss, _ in expected_results]
    state.detach()
    assert_bitwise_equal(expected, snapshot(training))
    streamer = handle.streamer
    stats = handle.read_stats()
    # every layer's gradients leave once a step, the resident unit's once: no running sum comes back
    assert stats.bytes_out == STEPS * (sum(u.grad_nbytes for u in streamer.layers) + streamer.resident.grad_nbytes)
    layer, resident = streamer.layers[0].nbytes, streamer.resident.nbytes
    if weight_slots >= SHAPE.num_layers:
        assert stats.bytes_in == STEPS * (SHAPE.num_layers * layer + resident)
    else:
        forwards = STEPS * SHAPE.num_micro_batches * SHAPE.num_layers * layer
        assert stats.bytes_in <= forwards + STEPS * (SHAPE.num_layers * layer + resident)
    handle.detach()
    assert tensor_parallel.checkpoint is original


def test_layer_major_backward_refuses_tied_embeddings(pool: MappedPool) -> None:
    with pool.allocating():
        training = build_gpt_training(SHAPE, recompute=True, tied=True)
    with pytest.raises(ValueError, match="--untie-embeddings-and-output-weights"):
        attach_weight_streamer(training.model, layer_major=True)


def test_params_and_grads_live_in_host_memory_between_steps(pool: MappedPool) -> None:
    gpu_before = gpu_only(torch.cuda.memory_allocated())
    training, handle, state = streamed_training(pool)
    gpu_for_model = gpu_only(torch.cuda.memory_allocated()) - gpu_before
    train(training, 2)
    torch.cuda.synchronize()
    streamed = [p for unit in handle.streamer.layers for p in (placed.param for placed in unit.placed)]
    for param in streamed:  # between steps, every pointer is megatron-core's own buffer view again
        assert param.data.data_ptr() == unit_home(handle, param)
    # the model cost the GPU less than its own weight and gradient buffers (slots and resident copies only)
    buffers = sum(b.param_data.nbytes + b.grad_data.nbytes for chunk in training.model for b in chunk.buffers)
    assert gpu_for_model < buffers, (gpu_for_model, buffers)
    state.detach()
    handle.detach()


def unit_home(handle, param) -> int:
    for unit in handle.streamer.layers:
        for placed in unit.placed:
            if placed.param is param:
                return placed.host_data.data_ptr()
    raise AssertionError("param not streamed")


@pytest.mark.parametrize("layer_major", [False, True])
def test_torch_dist_save_and_resume_with_streamed_weights_is_bitwise(
    reference, pool: MappedPool, tmp_path, layer_major: bool
) -> None:
    """Saved after 3 steps with weights streamed and state offloaded; the saving run goes on, and a run of
    another seed (its own weights and state in host memory) loads and goes on: both end bitwise where the
    uninterrupted run without offloading ends. In the loop's backward order and in the layer order."""
    from tests.gpu.test_checkpoint import load_checkpoint, save_checkpoint

    expected_results, expected = reference
    save_after = 3
    checkpoint_dir = tmp_path / "iter_0000003"
    checkpoint_dir.mkdir()
    saving, saving_weights, saving_state = streamed_training(pool, layer_major=layer_major)
    assert train(saving, save_after) == expected_results[:save_after]
    save_checkpoint(saving, str(checkpoint_dir))
    tail = [saving.train_step(i) for i in range(save_after, STEPS)]
    assert tail == expected_results[save_after:], "the save disturbed the run"
    saving_state.detach()
    assert_bitwise_equal(expected, snapshot(saving))
    saving_weights.detach()

    resumed, weights, state = streamed_training(pool, layer_major=layer_major, seed=4321)
    for iteration in (100, 101):  # torch Adam's state must exist before a load can be planned
        resumed.train_step(iteration)
    load_checkpoint(resumed, str(checkpoint_dir))
    tail = [resumed.train_step(i) for i in range(save_after, STEPS)]
    assert tail == expected_results[save_after:], "the resumed run's losses differ"
    state.detach()
    assert_bitwise_equal(expected, snapshot(resumed))
    weights.detach()
