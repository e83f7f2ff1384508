"""A megatron-core bf16 GPT training setup for the benchmarks that build one in their own process
(``offload_bandwidth.py``, ``sleep_wake.py``): local layer spec, torch LayerNorm, torch AdamW, DDP with
the distributed optimizer, as Megatron-LM's get_model / setup_model_and_optimizer / train_step do,
without TransformerEngine or apex. The GPU tests build theirs here too (tests/gpu/harness.py adds what only
tests need); it lives here so that a script a user runs never imports the test package.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import (
    model_parallel_cuda_manual_seed,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# build_gpt_training(recompute=True): every layer's forward recomputed in the backward, as Megatron-LM's
# --recompute-granularity full --recompute-method uniform --recompute-num-layers 1.
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


@dataclass
class GPTShape:
    """Model and batch sizes; the defaults are tiny so a step takes milliseconds."""

    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: int = 1024
    vocab_size: int = 1024
    seq_length: int = 128
    micro_batch_size: int = 2
    num_micro_batches: int = 2
    tie_embeddings: bool = True
    """Input embedding and output layer share their weights (configs/gpt_0p9b.yaml unties them)."""


def init_distributed(tensor_parallel: int = 1) -> None:
    """Init torch.distributed (NCCL) and megatron's parallel_state; safe to call twice.

    Under torchrun the env:// variables are used; without them this process becomes a 1-rank
    world with an in-process store. Pipeline parallel stays 1 (one model chunk).
    """
    if not torch.distributed.is_initialized():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            torch.distributed.init_process_group(backend="nccl")
        else:
            # A world of one needs no rendezvous: an in-process store, not a TCP port that another process
            # can take between asking the OS for it and listening on it.
            store = torch.distributed.HashStore()
            torch.distributed.init_process_group(backend="nccl", store=store, rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)


def destroy_distributed() -> None:
    """Tear down parallel_state and the process group (so a later init starts clean)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _microbatches(shape: GPTShape, iteration: int) -> list[Batch]:
    """Deterministic, learnable data: arithmetic token runs seeded by (iteration, DP rank).

    Seeding by DP rank (not global rank) keeps tensor-parallel peers on the same tokens.
    """
    gen = torch.Generator().manual_seed(iteration * 100_003 + parallel_state.get_data_parallel_rank())
    n, b, s = shape.num_micro_batches, shape.micro_batch_size, shape.seq_length
    start = torch.randint(0, shape.vocab_size, (n, b, 1), generator=gen)
    stride = torch.randint(1, 4, (n, b, 1), generator=gen)
    tokens = ((start + stride * torch.arange(s + 1)) % shape.vocab_size).cuda()
    position_ids = torch.arange(s, device="cuda").unsqueeze(0).repeat(b, 1)
    loss_mask = torch.ones(b, s, device="cuda")
    return [(t[:, :-1], t[:, 1:], loss_mask, position_ids) for t in tokens]


def _loss_func(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked token-sum loss plus token count, the 3-tuple form of both 0.16 and 0.19.

    The schedule divides the loss by num_tokens and num_microbatches itself (masked mean).
    """
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple[Any, Callable]:
    """GPTModel with labels returns the per-token loss [b, s]; no attention mask (causal)."""
    tokens, labels, loss_mask, position_ids = next(data_iterator)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, loss_mask)


@dataclass
class GPTTraining:
    """One built setup: DDP model chunks, the megatron optimizer and the model config."""

    model: list[DistributedDataParallel]
    optimizer: MegatronOptimizer  # a ChainedOptimizer of DistributedOptimizer(s)
    config: TransformerConfig  # holds finalize_model_grads_func and grad_scale_func
    shape: GPTShape
    loss_scale: float | None = None
    # Run once each, in order, right before the next optimizer step (a test's skipped step writes inf there).
    before_next_step: list[Callable[[list[DistributedDataParallel]], None]] = field(default_factory=list, repr=False)

    def train_step(self, iteration: int, read_loss: bool = True) -> tuple[float, bool]:
        """One iteration as in Megatron-LM's train_step; returns (mean loss, update_successful).

        ``read_loss=False`` leaves the loss on the GPU (NaN is returned), as Megatron-LM does between
        log intervals: reading it waits for every device-to-host copy queued before it.
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        shape = self.shape
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(_microbatches(shape, iteration)),
            model=self.model,
            num_microbatches=shape.num_micro_batches,
            seq_length=shape.seq_length,
            micro_batch_size=shape.micro_batch_size,
            forward_only=False,
        )
        while self.before_next_step:
            self.before_next_step.pop(0)(self.model)
        update_successful, _grad_norm, _num_zeros = self.optimizer.step()
        totals = torch.stack([d["lm loss"] for d in losses]).sum(dim=0)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        return (totals[0] / totals[1]).item() if read_loss else float("nan"), bool(update_successful)


def build_gpt_training(
    shape: GPTShape,
    seed: int = 1234,
    lr: float = 1e-3,
    clip_grad: float = 1.0,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    loss_scale: float | None = None,
    bucket_size: int | None = None,
    optimizer_overrides: dict[str, Any] | None = None,
    recompute: bool = False,
    layer_spec: Any = None,
    no_sync: bool = False,
) -> GPTTraining:
    """Build a bf16 GPTModel (local spec) in DDP with the distributed optimizer, as Megatron-LM does.

    Same seed -> bitwise-same initial params on every call in one process: python, torch (CPU and
    CUDA) and megatron's CUDA RNG tracker are reseeded first. Dropout is 0, so training draws no
    random numbers and two setups can be stepped interleaved. ``bucket_size`` (params per bucket)
    only matters with overlap_grad_reduce; 500_000 gives the default model 4 buckets. ``loss_scale``
    (use 1.0) adds megatron's constant grad scaler. ``recompute``: full recompute of every layer. ``layer_spec``:
    another layer spec than megatron-core's local one (the SDPA spec). ``no_sync``: the micro-batches but the
    last run under DDP's ``no_sync``, as Megatron-LM's loop always runs them (with ``overlap_grad_reduce`` they
    always do). ``shape.tie_embeddings``: the output layer shares the embedding's weight.
    """
    if overlap_param_gather and not overlap_grad_reduce:
        raise ValueError("overlap_param_gather needs overlap_grad_reduce (as in Megatron-LM)")
    if not parallel_state.model_parallel_is_initialized():
        init_distributed()
    random.seed(seed)
    torch.manual_seed(seed)  # CPU generator: torch.nn.Embedding (positions) inits on CPU
    model_parallel_cuda_manual_seed(seed)  # resets the tracker states too

    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn_hidden_size,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,  # fused softmax kernels come from apex
        gradient_accumulation_fusion=False,  # needs apex's fused_weight_gradient_mlp_cuda
        **(FULL_RECOMPUTE if recompute else {}),
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec or get_gpt_layer_local_spec(),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        share_embeddings_and_output_weights=shape.tie_embeddings,
    )
    for param in gpt.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)  # as get_model does
    gpt.cuda(torch.cuda.current_device())  # torch LayerNorm/position embedding start on CPU
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # Megatron-LM's default for bf16
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
    )
    model = [DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))]

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=0.01,
            clip_grad=clip_grad,
            bf16=True,
            use_distributed_optimizer=True,
            loss_scale=loss_scale,
            **(optimizer_overrides or {}),
        ),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if overlap_grad_reduce or no_sync:  # as Megatron-LM's train(): sync grads only on the last microbatch
        config.no_sync_func = model[0].no_sync
    return GPTTraining(model, optimizer, config, shape, loss_scale=loss_scale)


def state_bytes(training: GPTTraining) -> int:
    """The fp32 master and Adam state of this rank: 12 bytes per parameter shard the optimizer steps."""
    from megatron_offload.megatron.optimizer_adapter import distributed_optimizers

    inner = [dist_opt.optimizer for dist_opt in distributed_optimizers(training.optimizer)]
    return 12 * sum(param.numel() for opt in inner for group in opt.param_groups for param in group["params"])
