"""A real megatron-core bf16 GPT training setup for GPU tests (benchmarks/gpt_training.py, which the
benchmarks share, plus what only tests need: a forced skipped step, parameter snapshots).

Tests build it twice in one process (baseline and with optimizer-state offloading), train
both for N steps and compare bitwise. It mirrors Megatron-LM's get_model / setup_model_and_optimizer /
train_step without TransformerEngine or apex (absent on the GPU machine): local layer spec, torch
LayerNorm (megatron-core's no-apex fallback), torch AdamW (its no-TE/apex Adam). Every call here has
the same signature and behaviour in megatron-core 0.16.1 and 0.19.2, so no version branches are needed;
0.19 only logs two warnings (GPTModel deprecated; DDP computing full_param_layout itself, which is
what Megatron-LM precomputes with the same function).
"""

from __future__ import annotations

import sys
from pathlib import Path

import megatron.core
import torch
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpt_training import (  # noqa: E402
    Batch,
    GPTShape,
    GPTTraining,
    build_gpt_training,
    destroy_distributed,
    init_distributed,
    state_bytes,
)

__all__ = [
    "MCORE_VERSION",
    "Batch",
    "GPTShape",
    "GPTTraining",
    "build_gpt_training",
    "destroy_distributed",
    "force_skipped_step",
    "init_distributed",
    "param_snapshot",
    "state_bytes",
]

MCORE_VERSION = Version(megatron.core.__version__)  # for tests that need to tell versions apart


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
    training.skip_next_step = True


def param_snapshot(training: GPTTraining) -> dict[str, torch.Tensor]:
    """Clone every bf16 model param; with overlap_param_gather first run the all-gather that would
    otherwise wait for the next forward's pre-hooks (the optimizer only wrote this rank's shard)."""
    chunk = training.model[0]
    if chunk.ddp_config.overlap_param_gather:
        chunk.start_param_sync(force_sync=True)
    return {name: p.detach().clone() for name, p in chunk.named_parameters()}
