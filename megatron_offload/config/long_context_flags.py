"""The long-context flags and the combinations they support, checked before anything is built.

``--offload-layer-inputs`` moves the input full recompute keeps for each checkpointed layer to pinned
host memory; ``--chunked-loss`` computes the output layer and cross entropy a chunk of tokens at a time.
Attention is a layer spec (``--spec megatron_offload.megatron.sdpa_spec gpt_layer_spec``), checked here too
where it is named. Everything else is refused in one line naming the flag and what to do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_offload.config.refusals import CUDA_GRAPHS, Check, is_not, is_other_than, on, over_one, refuse, set_

__all__ = [
    "SDPA_SPEC",
    "LongContextConfig",
    "add_long_context_args",
    "check_long_context_flags",
    "layer_input_bytes_per_rank",
    "long_context_config_from_args",
    "uses_sdpa_spec",
]

LAYER_INPUTS = "--offload-layer-inputs"
CHUNKED_LOSS = "--chunked-loss"
SDPA_SPEC = ["megatron_offload.megatron.sdpa_spec", "gpt_layer_spec"]


@dataclass(frozen=True)
class LongContextConfig:
    """Long-context training as the flags ask for it, read once after validation."""

    layer_inputs: bool = False
    """Each checkpointed layer's input waits in pinned host memory until its recompute."""
    chunked_loss: bool = False
    """The output layer and cross entropy a chunk of tokens at a time."""
    chunk_tokens: int | None = None
    """Tokens per chunk of the chunked loss; None: about 256 MiB of fp32 logits per chunk."""

    @property
    def wanted(self) -> bool:
        return self.layer_inputs or self.chunked_loss


def long_context_config_from_args(args: argparse.Namespace) -> LongContextConfig:
    """The long-context settings of parsed (and checked) arguments."""
    tokens = getattr(args, "chunked_loss_tokens", None)
    return LongContextConfig(on(args, "offload_layer_inputs"), on(args, "chunked_loss"), tokens)


def add_long_context_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        LAYER_INPUTS,
        action="store_true",
        help="Under --recompute-granularity full, send each checkpointed layer's input to pinned host memory "
        "after its forward and bring it back ahead of its recompute: saves layers x tokens x hidden x 2 bytes "
        "per micro-batch of GPU memory. With or without --offload-weights.",
    )
    group.add_argument(
        CHUNKED_LOSS,
        action="store_true",
        help="Compute the output layer and the cross entropy a chunk of tokens at a time, recomputing each "
        "chunk's logits in backward: the [tokens, vocab] logits and their fp32 softmax never exist "
        "(one chunk's do). Needs --tensor-model-parallel-size 1 and megatron-core 0.19 or later.",
    )
    group.add_argument(
        "--chunked-loss-tokens",
        type=int,
        default=None,
        metavar="N",
        help="Tokens per chunk of --chunked-loss (default: so that one chunk's fp32 logits take about 256 MiB).",
    )


_LAYER_INPUTS: list[Check] = [
    ("recompute_granularity", is_not("full"), "moves what full recompute keeps: add --recompute-granularity full"),
    ("distribute_saved_activations", on, "cannot move inputs split across tensor-parallel ranks: drop it"),
    ("fp8", set_, "does not support fp8 yet (its checkpoint is TransformerEngine's): drop it"),
    ("fp4", set_, "does not support fp4 yet (its checkpoint is TransformerEngine's): drop it"),
    ("cpu_offloading", on, "and TransformerEngine's activation offloading cannot be combined: drop one"),
    ("fine_grained_activation_offloading", on, "and fine-grained activation offloading cannot be combined: drop one"),
    *CUDA_GRAPHS,
]

_CHUNKED_LOSS: list[Check] = [
    ("tensor_model_parallel_size", over_one, "needs the whole vocabulary on each rank: set it to 1"),
    ("mtp_num_layers", set_, "does not compute multi-token-prediction losses: drop it"),
    ("cross_entropy_loss_fusion", on, "replaces the fused cross entropy: drop --cross-entropy-loss-fusion"),
    ("fp16_lm_cross_entropy", on, "computes the loss in fp32: drop --fp16-lm-cross-entropy"),
    ("use_mup", on, "does not apply MuP's output scaling: drop it"),
]


def uses_sdpa_spec(args: argparse.Namespace) -> bool:
    return list(getattr(args, "spec", None) or []) == SDPA_SPEC


_SDPA: list[Check] = [
    ("context_parallel_size", over_one, "runs without context parallelism: set it to 1"),
    ("window_size", set_, "has no sliding window: drop it"),
    ("softmax_type", is_other_than("vanilla"), "use vanilla"),
    (
        "create_attention_mask_in_dataloader",
        on,
        "attends causally and reads no mask, which takes seq-length squared bytes per sample in host and GPU "
        "memory: add --no-create-attention-mask-in-dataloader",
    ),
]


def check_long_context_flags(args: argparse.Namespace) -> None:
    """Raise ValueError, one line naming the flag and what to do, for a combination not supported."""
    tokens = getattr(args, "chunked_loss_tokens", None)
    if tokens is not None and tokens < 1:
        raise ValueError(f"--chunked-loss-tokens must be a positive number of tokens, got {tokens}")
    if tokens is not None and not on(args, "chunked_loss"):
        raise ValueError("--chunked-loss-tokens sets the chunks of --chunked-loss: add --chunked-loss or drop it")
    if on(args, "offload_layer_inputs"):
        refuse(args, LAYER_INPUTS, _LAYER_INPUTS)
    if on(args, "chunked_loss"):
        refuse(args, CHUNKED_LOSS, _CHUNKED_LOSS)
    if uses_sdpa_spec(args):
        refuse(args, "the SDPA layer spec", _SDPA)


def layer_input_bytes_per_rank(args: argparse.Namespace) -> int:
    """Host bytes --offload-layer-inputs pins on a rank: one input per checkpointed chunk of layers, for
    every micro-batch a pipeline keeps in flight (one without pipeline parallelism)."""
    if not on(args, "offload_layer_inputs"):
        return 0
    layers = getattr(args, "num_layers", 0) or 0
    pipeline = getattr(args, "pipeline_model_parallel_size", 1) or 1
    per_chunk = getattr(args, "recompute_num_layers", 1) or 1
    per_stage = layers // pipeline
    # uniform: every chunk of ``per_chunk`` layers is checkpointed; block: the first ``per_chunk`` layers, one each
    block = getattr(args, "recompute_method", "uniform") == "block"
    chunks = min(per_chunk, per_stage) if block else -(-per_stage // per_chunk)
    tokens = (getattr(args, "seq_length", 0) or 0) * (getattr(args, "micro_batch_size", 1) or 1)
    tokens //= getattr(args, "tensor_model_parallel_size", 1) if on(args, "sequence_parallel") else 1
    width = 4 if not (on(args, "bf16") or on(args, "fp16")) else 2
    return chunks * tokens * (getattr(args, "hidden_size", 0) or 0) * width * pipeline
