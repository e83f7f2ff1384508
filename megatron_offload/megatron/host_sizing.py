"""How much host memory a run will pin on each rank, counted from Megatron-LM's parsed arguments. The training
hooks check at argument validation, before the model is built, that the node can hold it, so that a node too
small stops there in one line rather than partway into building the model.

The count is Megatron's own parameter count, made before Megatron knows every figure that count reads (see
``state_bytes_per_rank``): an estimate, and a lower bound where in doubt. The engine checks exactly when it
attaches.
"""

from __future__ import annotations

import argparse
import copy

from megatron_offload.config.flags import offload_requested
from megatron_offload.megatron.weights_training import BYTES_PER_PARAM

__all__ = ["host_bytes_per_rank", "state_bytes_per_rank", "wants_host_memory"]


def state_bytes_per_rank(args: argparse.Namespace) -> int | None:
    """Host bytes the offloaded state will take on this rank (its most loaded shard), from Megatron's own
    parameter count (``theoretical_memory_usage``), which charges a parameter 6 + 12/DP bytes with the
    distributed optimizer; None where it cannot count this model (the engine checks exactly at attach).

    NOTE: this runs in argument validation, before Megatron builds the tokenizer, which is what sets
    ``padded_vocab_size`` (megatron.core.tokenizers.utils.build_tokenizer); Megatron's count needs it. The
    count is made on a copy of ``args`` with the vocabulary padded as Megatron will pad ``--vocab-size``
    (``vocab_size_with_padding``), or, where the size comes from a tokenizer file, with no embedding at all:
    a lower bound, so the check refuses only a node that is short for certain."""
    try:
        from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

        counted = copy.copy(args)  # Megatron's count sets fields on what it is given
        if getattr(counted, "padded_vocab_size", None) is None:
            counted.padded_vocab_size = _padded_vocab_size(args)
        data_parallel = args.data_parallel_size
        params = compute_weight_and_optimizer_memory(counted) / (6 + 12 / data_parallel)
    except Exception:  # an estimate: a model it cannot count is checked exactly at attach instead
        return None
    return int(params * (12 if getattr(args, "offload_master_weights", True) else 8) / data_parallel)


def _padded_vocab_size(args: argparse.Namespace) -> int:
    """``--vocab-size`` padded as Megatron pads it (a multiple of ``make_vocab_size_divisible_by`` times the
    tensor-parallel size); 0 where the size will come from a tokenizer's files."""
    vocab = getattr(args, "vocab_size", None)
    if not vocab:
        return 0
    multiple = getattr(args, "make_vocab_size_divisible_by", 128) * getattr(args, "tensor_model_parallel_size", 1)
    return -(-int(vocab) // multiple) * multiple


def host_bytes_per_rank(args: argparse.Namespace) -> int | None:
    """Host bytes this rank will pin: the optimizer state, or with --offload-weights everything of the
    model (``BYTES_PER_PARAM`` per parameter)."""
    state = state_bytes_per_rank(args)
    if state is None or not getattr(args, "offload_weights", False):
        return state
    per_param_state = 12 if getattr(args, "offload_master_weights", True) else 8
    return state // per_param_state * BYTES_PER_PARAM


def wants_host_memory(args: argparse.Namespace) -> bool:
    """Whether this run pins host memory of ours: offloaded state, streamed weights or layer inputs."""
    return offload_requested(args) or bool(getattr(args, "offload_layer_inputs", False))
