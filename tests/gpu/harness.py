"""A real megatron-core bf16 GPT training setup for GPU tests.

Tests build it twice in one process (baseline and with optimizer-state offloading), train both for N steps
and compare bitwise. The setup is the benchmarks' (``benchmarks/gpt_training.py``: Megatron-LM's get_model /
setup_model_and_optimizer / train_step without TransformerEngine or apex, the same in megatron-core 0.16.1
and 0.19.2); here is what only tests need: the output layer untied unless a test asks, and a step skipped the way
megatron-core skips one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron.core.distributed import DistributedDataParallel

from benchmarks import gpt_training
from benchmarks.gpt_training import GPTShape, GPTTraining, init_distributed, state_bytes

__all__ = [
    "GPTShape",
    "GPTTraining",
    "build_gpt_training",
    "force_skipped_step",
    "init_distributed",
    "state_bytes",
]


def build_gpt_training(shape: GPTShape, *args: Any, tied: bool = False, **kwargs: Any) -> GPTTraining:
    """``benchmarks.gpt_training.build_gpt_training`` with the output layer untied unless ``tied`` (megatron-core's
    default; Megatron-LM's is tied), whatever ``shape.tie_embeddings`` says: each test names what it trains."""
    return gpt_training.build_gpt_training(replace(shape, tie_embeddings=tied), *args, **kwargs)


def _poison_one_main_grad(model: list[DistributedDataParallel]) -> None:
    """Write inf into one parameter's main_grad (the fp32 grad buffer the optimizer reads)."""
    param = next(p for p in model[0].parameters() if p.requires_grad)
    param.main_grad.fill_(float("inf"))


def force_skipped_step(training: GPTTraining) -> None:
    """Make the next ``train_step``'s optimizer.step() be skipped the way megatron-core skips one.

    megatron-core skips only in MixedPrecisionOptimizer.prepare_grads, and only with a grad scaler:
    it unscales the main grads with torch._amp_foreach_non_finite_check_and_unscale_, all-reduces
    found_inf (MAX) over all ranks, and ChainedOptimizer.step returns (False, None, None) before
    clipping, the Adam step and the param copy. bf16 with loss_scale=None has no scaler, hence no inf
    check (0.19's grad_norm_skip_threshold is another, 0.19-only path). So build with loss_scale=1.0
    (ConstantGradScaler; x*1.0 is exact, results stay bitwise equal to None); the next train_step then
    writes inf into one main_grad after backward and the grad reduce-scatter, right before step().
    """
    if not training.loss_scale:
        raise ValueError("force_skipped_step needs build_gpt_training(..., loss_scale=1.0)")
    training.before_next_step.append(_poison_one_main_grad)
