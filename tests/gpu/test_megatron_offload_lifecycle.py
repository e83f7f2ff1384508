"""Real megatron-core GPT + DDP + DistributedOptimizer (bf16) with offloading: memory it frees and gives back, a
failure inside the step, detaching, and other offloaders refused.

Runs on the GPU machine only (see scripts/device_check.sh).
"""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests train a megatron-core GPT model", allow_module_level=True)
psutil = pytest.importorskip("psutil", reason="the leak test reads the process's resident memory")
pytest.importorskip("megatron.core", reason="needs megatron-core installed (scripts/device_check.sh does it)")

from megatron_offload import attach_offloader  # noqa: E402
from megatron_offload.megatron.optimizer_adapter import distributed_optimizers  # noqa: E402
from megatron_offload.optimizer_state.chunk_step import ChunkStepper  # noqa: E402
from tests.gpu.harness import GPTShape, GPTTraining, build_gpt_training, init_distributed  # noqa: E402
from tests.gpu.parity import snapshot, train  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    init_distributed()


def pinned_by_torch() -> int:
    """Bytes held by PyTorch's pinned caching allocator (a per-step pinned staging buffer would show here)."""
    keys = [key for key in torch.cuda.host_memory_stats() if "allocated_bytes" in key and key.endswith("current")]
    assert keys, f"no allocated-bytes entry in torch.cuda.host_memory_stats(): {torch.cuda.host_memory_stats()}"
    return sum(torch.cuda.host_memory_stats()[key] for key in keys)


def test_allocated_memory_drops_by_the_offloaded_bytes() -> None:
    shape = GPTShape(num_layers=4, hidden_size=1024, ffn_hidden_size=4096)

    def first_iteration_peak(attach: bool) -> tuple[int, GPTTraining, object]:
        gc.collect()
        before = torch.cuda.memory_allocated()
        training = build_gpt_training(shape)
        # Small chunks: the streamed step's three staging chunks are then small beside this small state.
        handle = attach_offloader(training.optimizer, chunk_mb=8, fraction=1.0) if attach else None
        torch.cuda.reset_peak_memory_stats()
        train(training, 1)
        return torch.cuda.max_memory_allocated() - before, training, handle

    baseline_peak, baseline, _ = first_iteration_peak(attach=False)
    del baseline
    offload_peak, training, handle = first_iteration_peak(attach=True)
    train(training, 1)
    dist_opt = distributed_optimizers(training.optimizer)[0]
    masters = sum(m.numel() for group in dist_opt.shard_fp32_from_float16_groups for m in group)
    moments = sum(p.numel() for group in dist_opt.optimizer.param_groups for p in group["params"]) * 2
    expected_bytes = 4 * (masters + moments)

    handle.wait()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    handle.offload()
    assert handle.pending_offload_bytes() > 0  # freed as each copy lands, not before
    handle.drain_offloads()
    offloaded = torch.cuda.memory_allocated()
    stats = handle.read_stats()
    assert stats.gpu_bytes_freed == expected_bytes == stats.host_bytes
    assert stats.pinned
    assert abs((resident - offloaded) - expected_bytes) <= 0.01 * expected_bytes
    # Adam's first step streams too (its moments join their chunks): iteration 1's peak, at the
    # step for this short-sequence shape, is lower by about the whole state.
    assert baseline_peak - offload_peak >= 0.9 * expected_bytes, (baseline_peak, offload_peak, expected_bytes)
    handle.detach()


def test_many_cycles_leak_neither_gpu_nor_pinned_memory() -> None:
    training = build_gpt_training(GPTShape())
    handle = attach_offloader(training.optimizer, fraction=1.0)
    train(training, 2)
    readings, rss = [], []
    for cycle in range(200):
        handle.wait()
        handle.offload()
        if cycle in (9, 199):
            handle.drain_offloads()  # every copy out landed and its memory freed
            readings.append((torch.cuda.memory_allocated(), pinned_by_torch(), handle.read_stats().host_bytes))
            rss.append(psutil.Process().memory_info().rss)
    assert readings[0] == readings[1]
    assert rss[1] - rss[0] < 32 * 2**20  # the host slabs are made once, not per cycle
    assert handle.read_stats().offloads == 203  # one at attach, two in training, 200 cycles
    handle.detach()


def test_exception_inside_step_leaves_state_whole_and_offloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    training = build_gpt_training(GPTShape())
    handle = attach_offloader(training.optimizer, fraction=1.0)
    train(training, 3)
    handle.wait()
    before = snapshot(training)
    handle.offload()
    inner = distributed_optimizers(training.optimizer)[0].optimizer

    def broken_step(*args, **kwargs):
        raise RuntimeError("injected failure inside Adam")

    monkeypatch.setattr(ChunkStepper, "__call__", broken_step)  # what the streamed step calls per chunk
    assert inner is not None
    with pytest.raises(RuntimeError, match="injected failure"):
        training.train_step(3)
    monkeypatch.undo()
    assert all(offloader.is_offloaded for offloader in handle.offloaders)
    handle.wait()
    after = snapshot(training)
    optimizer_keys = [key for key in before if key.startswith("opt")]
    assert all(torch.equal(before[key], after[key]) for key in optimizer_keys)
    handle.detach()


def test_detach_restores_megatron_objects() -> None:
    training = build_gpt_training(GPTShape())
    finalize = training.config.finalize_model_grads_func
    handle = attach_offloader(training.optimizer, prefetch="finalize")
    assert training.config.finalize_model_grads_func is not finalize  # prefetch hook installed
    train(training, 2)
    handle.detach()
    assert training.config.finalize_model_grads_func is finalize
    assert "step" not in vars(training.optimizer)
    for dist_opt in distributed_optimizers(training.optimizer):
        assert "step" not in vars(dist_opt.optimizer) and "_copy_main_params_to_model_params" not in vars(dist_opt)
    auto = attach_offloader(training.optimizer)
    train(training, 1)
    auto.detach()
    assert not any(p._post_accumulate_grad_hooks for chunk in training.model for p in chunk.parameters())
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
