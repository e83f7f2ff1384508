"""Real megatron-core GPT + DDP + DistributedOptimizer (bf16) with and without offloading.

Runs on the GPU machine only (see scripts/device_check.sh). Everything is compared with torch.equal:
offloading must not change a single bit of training.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests train a megatron-core GPT model", allow_module_level=True)
psutil = pytest.importorskip("psutil", reason="the leak test reads the process's resident memory")
pytest.importorskip("megatron.core", reason="needs megatron-core installed (scripts/device_check.sh does it)")

from megatron_offload import PrefetchPolicy, attach_offloader  # noqa: E402
from megatron_offload.megatron_adapter import distributed_optimizers  # noqa: E402
from tests.gpu.harness import GPTShape, GPTTraining, build_gpt_training, force_skipped_step, init_distributed  # noqa: E402

STEPS = 20
SKIPPED_ITERATION = 7


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    init_distributed()


def snapshot(training: GPTTraining) -> dict[str, torch.Tensor]:
    """Every number training produces: model params, fp32 masters, Adam moments (cloned)."""
    tensors: dict[str, torch.Tensor] = {}
    for chunk_index, chunk in enumerate(training.model):
        for name, param in chunk.named_parameters():
            tensors[f"model{chunk_index}.{name}"] = param.detach().clone()
    for opt_index, dist_opt in enumerate(distributed_optimizers(training.optimizer)):
        for group_index, group in enumerate(dist_opt.shard_fp32_from_float16_groups):
            for i, master in enumerate(group):
                tensors[f"opt{opt_index}.master.{group_index}.{i}"] = master.detach().clone()
        inner = dist_opt.optimizer
        for group_index, group in enumerate(inner.param_groups):
            for i, param in enumerate(group["params"]):
                for key, value in inner.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.shape == param.shape:
                        tensors[f"opt{opt_index}.{group_index}.{i}.{key}"] = value.detach().clone()
    return tensors


def pinned_by_torch() -> int:
    """Bytes held by PyTorch's pinned caching allocator (a per-step pinned staging buffer would show here)."""
    keys = [key for key in torch.cuda.host_memory_stats() if "allocated_bytes" in key and key.endswith("current")]
    assert keys, f"no allocated-bytes entry in torch.cuda.host_memory_stats(): {torch.cuda.host_memory_stats()}"
    return sum(torch.cuda.host_memory_stats()[key] for key in keys)


def train(training: GPTTraining, steps: int, skip_at: int | None = None) -> list[tuple[float, bool]]:
    results = []
    for iteration in range(steps):
        if iteration == skip_at:
            force_skipped_step(training)
        results.append(training.train_step(iteration))
    return results


def assert_bitwise_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    assert any("exp_avg_sq" in key for key in expected) and any(".master." in key for key in expected)
    different = [key for key in expected if not torch.equal(expected[key], actual[key])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def reference() -> tuple[list[tuple[float, bool]], dict[str, torch.Tensor]]:
    """The run without offloading that every offloaded run must match, skipped step included."""
    training = build_gpt_training(GPTShape(), loss_scale=1.0)
    results = train(training, STEPS, skip_at=SKIPPED_ITERATION)
    assert results[SKIPPED_ITERATION][1] is False and all(
        ok for i, (_, ok) in enumerate(results) if i != SKIPPED_ITERATION
    )
    state = snapshot(training)
    del training
    return results, state


@pytest.mark.parametrize("prefetch", list(PrefetchPolicy))
@pytest.mark.parametrize("offload_master_weights", [True, False])
def test_bitwise_parity_with_a_skipped_step(reference, prefetch: PrefetchPolicy, offload_master_weights: bool) -> None:
    expected_results, expected_state = reference
    training = build_gpt_training(GPTShape(), loss_scale=1.0)
    handle = attach_offloader(training.optimizer, prefetch=prefetch, offload_master_weights=offload_master_weights)
    results = train(training, STEPS, skip_at=SKIPPED_ITERATION)
    stats = handle.read_stats()
    assert all(offloader.is_offloaded for offloader in handle.offloaders)
    assert stats.offloads == STEPS and stats.gpu_bytes_freed > 0
    handle.wait()
    assert results == expected_results
    assert_bitwise_equal(expected_state, snapshot(training))
    handle.detach()


def test_allocated_memory_drops_by_the_offloaded_bytes() -> None:
    training = build_gpt_training(GPTShape(num_layers=4, hidden_size=1024, ffn_hidden_size=4096))
    handle = attach_offloader(training.optimizer)
    train(training, 2)
    dist_opt = distributed_optimizers(training.optimizer)[0]
    masters = sum(m.numel() for group in dist_opt.shard_fp32_from_float16_groups for m in group)
    moments = sum(p.numel() for group in dist_opt.optimizer.param_groups for p in group["params"]) * 2
    expected_bytes = 4 * (masters + moments)

    handle.wait()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    handle.offload()
    torch.cuda.synchronize()
    offloaded = torch.cuda.memory_allocated()
    stats = handle.read_stats()
    assert stats.gpu_bytes_freed == expected_bytes == stats.host_bytes
    assert stats.pinned
    assert abs((resident - offloaded) - expected_bytes) <= 0.01 * expected_bytes
    handle.detach()


def test_many_cycles_leak_neither_gpu_nor_pinned_memory() -> None:
    training = build_gpt_training(GPTShape())
    handle = attach_offloader(training.optimizer)
    train(training, 2)
    readings, rss = [], []
    for cycle in range(200):
        handle.wait()
        handle.offload()
        if cycle in (9, 199):
            torch.cuda.synchronize()
            readings.append((torch.cuda.memory_allocated(), pinned_by_torch(), handle.read_stats().host_bytes))
            rss.append(psutil.Process().memory_info().rss)
    assert readings[0] == readings[1]
    assert rss[1] - rss[0] < 32 * 2**20  # the host slabs are made once, not per cycle
    assert handle.read_stats().offloads == 202
    handle.detach()


def test_exception_inside_step_leaves_state_whole_and_offloaded() -> None:
    training = build_gpt_training(GPTShape())
    handle = attach_offloader(training.optimizer)
    train(training, 3)
    handle.wait()
    before = snapshot(training)
    handle.offload()
    inner = distributed_optimizers(training.optimizer)[0].optimizer

    def broken_step(*args, **kwargs):
        raise RuntimeError("injected failure inside Adam")

    inner.step = broken_step
    with pytest.raises(RuntimeError, match="injected failure"):
        training.train_step(3)
    del inner.step
    assert all(offloader.is_offloaded for offloader in handle.offloaders)
    handle.wait()
    after = snapshot(training)
    optimizer_keys = [key for key in before if key.startswith("opt")]
    assert all(torch.equal(before[key], after[key]) for key in optimizer_keys)
    handle.detach()


def test_detach_restores_megatron_objects() -> None:
    training = build_gpt_training(GPTShape())
    finalize = training.config.finalize_model_grads_func
    handle = attach_offloader(training.optimizer)
    assert training.config.finalize_model_grads_func is not finalize  # prefetch hook installed
    train(training, 2)
    handle.detach()
    assert training.config.finalize_model_grads_func is finalize
    assert "step" not in vars(training.optimizer)
    assert all(t.untyped_storage().nbytes() > 0 for t in snapshot(training).values())
    attach_offloader(training.optimizer).detach()  # attaching again after detach works


def test_refuses_to_fight_other_offloaders() -> None:
    training = build_gpt_training(GPTShape())
    dist_opt = distributed_optimizers(training.optimizer)[0]
    dist_opt.config.offload_optimizer_states = True  # what Megatron-LM's dev branch sets
    with pytest.raises(ValueError, match="its own optimizer-state offloading"):
        attach_offloader(training.optimizer)
    dist_opt.config.offload_optimizer_states = False
    dist_opt.config.optimizer_cpu_offload = True
    with pytest.raises(ValueError, match="--optimizer-cpu-offload"):
        attach_offloader(training.optimizer)
    dist_opt.config.optimizer_cpu_offload = False
    handle = attach_offloader(training.optimizer)
    with pytest.raises(RuntimeError, match="already attached"):
        attach_offloader(training.optimizer)
    handle.detach()
