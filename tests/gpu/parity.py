"""What every GPU test that compares training with and without a feature reads: every number training produces,
a run of iterations, and a bitwise comparison."""

from __future__ import annotations

import torch

from megatron_offload.megatron.optimizer_adapter import distributed_optimizers
from tests.gpu.harness import GPTTraining, force_skipped_step

__all__ = ["assert_bitwise_equal", "masters_of", "snapshot", "train"]


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


def masters_of(training: GPTTraining) -> list[torch.Tensor]:
    dist_opts = distributed_optimizers(training.optimizer)
    return [m for opt in dist_opts for group in opt.shard_fp32_from_float16_groups for m in group]
