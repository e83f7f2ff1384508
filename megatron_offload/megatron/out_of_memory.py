"""One line for a run that ran out of GPU memory: what it asked for, what it held, the cap, and what moves
more off the GPU, from the flags it ran with (Megatron's parsed arguments), instead of a bare CUDA
out-of-memory traceback."""

from __future__ import annotations

import argparse
import re

from megatron_offload.config.long_context_flags import uses_sdpa_spec

__all__ = ["out_of_memory_line", "what_to_add"]

LONG = 8192  # tokens per micro-batch from which attention scores, layer inputs and logits dominate

_ASKED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")


def what_to_add(args: argparse.Namespace) -> list[str]:
    """The flags that would take more off the GPU, the largest saving first, for a run with ``args``."""
    on = lambda name: bool(getattr(args, name, False))  # noqa: E731
    long = (getattr(args, "seq_length", 0) or 0) * (getattr(args, "micro_batch_size", 1) or 1) >= LONG
    full = getattr(args, "recompute_granularity", None) == "full"
    advice = []
    if long and not uses_sdpa_spec(args) and getattr(args, "transformer_impl", "local") == "local":
        advice.append("--spec megatron_offload.megatron.sdpa_spec gpt_layer_spec (attention without [s, s] scores)")
    if not on("offload_optimizer_states"):
        advice.append("--offload-optimizer-states")
    elif not on("offload_weights"):
        advice.append("--offload-weights (with full recompute one layer at a time)")
    if not full:
        advice.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    elif long and not on("offload_layer_inputs"):
        advice.append("--offload-layer-inputs")
    if long and not on("chunked_loss") and (getattr(args, "tensor_model_parallel_size", 1) or 1) == 1:
        advice.append("--chunked-loss")
    if not advice and (getattr(args, "micro_batch_size", 1) or 1) > 1:
        advice.append("a smaller --micro-batch-size (more micro-batches per step)")
    return advice


def out_of_memory_line(error: BaseException, args: argparse.Namespace | None, peak_reserved: int, gib: int) -> str:
    """The line to print for ``error`` (a ``torch.OutOfMemoryError``); ``peak_reserved`` in bytes."""
    asked = _ASKED.search(str(error))
    cap = getattr(args, "offload_gpu_memory_cap_gib", None) if args is not None else None
    held = f"{peak_reserved / gib:.2f} GiB reserved at the peak"
    where = f"under --offload-gpu-memory-cap-gib {cap:g}" if cap else "on this GPU"
    line = f"megatron-offload: out of GPU memory {where}: asked for {asked.group(1) if asked else 'more'} with {held}"
    advice = what_to_add(args) if args is not None else []
    if advice:
        return f"{line}. To move more off the GPU, add: {'; '.join(advice)}"
    return f"{line}. Every offload this run can use is on: raise the cap or use a larger GPU"
