"""One line for a run that ran out of GPU memory: what it asked for, what it held, the cap, and what moves
more off the GPU, from the flags it ran with (Megatron's parsed arguments), instead of a bare CUDA
out-of-memory traceback. Where the whole optimizer state was in host memory already (the smallest
footprint did not fit), the line says what training needs without it, as measured, against the limit; where
the offloaders kept some of it on the GPU, it names the smallest footprint (``--offload-prefetch step``) first.
It also says where in the iteration memory ran out (a forward, a backward or the optimizer's step, and whether
in this project's hooks that move optimizer state), from the frames the error passed through."""

from __future__ import annotations

import argparse
import logging
import re
import traceback

from megatron_offload.config.long_context_flags import SDPA_SPEC, uses_sdpa_spec
from megatron_offload.config.refusals import on, over_one

__all__ = [
    "asked_bytes",
    "line_for",
    "out_of_memory_line",
    "quiet_megatron_out_of_memory_warning",
    "raised_in",
    "what_to_add",
]

LONG = 8192  # tokens per micro-batch from which attention scores, layer inputs and logits dominate

_ASKED = re.compile(r"Tried to allocate ([\d.]+) ([KMGT]?)i?B")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# Frames that tell where an error was raised, the innermost phase first: OffloadHandle's wrapper of the
# optimizer's step, torch.autograd's entry into its engine (a hook's or a kernel's error in backward keeps
# the frames it was raised in), torch.nn.Module's call.
_PHASES = (
    ("step_with_offload", "the optimizer step"),
    ("_engine_run_backward", "a backward"),
    ("custom_backward", "a backward"),  # megatron-core's schedules call autograd's engine directly
    ("_call_impl", "a forward"),
)
# This project's hooks that move optimizer state (backward_prefetch, pacing).
_HOOKS = (("on_grad_ready", "while optimizer state came back"), ("before_forward", "while optimizer state left"))


# megatron-core's straggler timer (``StragglerDetector.__exit__``, around each forward step in Megatron-LM's
# scripts) logs every error raised inside it, with its whole traceback, as a warning of this logger before the
# error goes on; for an out-of-memory the launcher's line says it instead.
_MEGATRON_TIMER_LOGGER = "megatron.core.utils"
_CUDA_OUT_OF_MEMORY = "CUDA out of memory"


class _NoOutOfMemoryTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_CUDA_OUT_OF_MEMORY)


def quiet_megatron_out_of_memory_warning() -> None:
    """Drop megatron-core's warning that repeats a CUDA out-of-memory with its traceback (the launcher prints
    its one line for it); every other warning of that logger, other errors' included, stays."""
    logger = logging.getLogger(_MEGATRON_TIMER_LOGGER)
    if not any(isinstance(f, _NoOutOfMemoryTraceback) for f in logger.filters):
        logger.addFilter(_NoOutOfMemoryTraceback())


def asked_bytes(error: BaseException) -> int:
    """The bytes the failed allocation asked for, as CUDA's message gives them (0 where it does not)."""
    asked = _ASKED.search(str(error))
    return int(float(asked.group(1)) * _UNITS[asked.group(2)]) if asked else 0


def raised_in(error: BaseException, iteration: int | None = None) -> str:
    """Where ``error`` was raised, as in "in a backward of iteration 3, while optimizer state came back"
    (``iteration``: Megatron's, counted from 1), or "" where no frame tells."""
    names = {frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)}  # no source read
    phase = next((text for name, text in _PHASES if name in names), None)
    if phase is None:
        return ""
    hook = next((text for name, text in _HOOKS if name in names), None)
    return f"in {phase}" + (f" of iteration {iteration}" if iteration else "") + (f", {hook}" if hook else "")


def what_to_add(args: argparse.Namespace, kept_gib: float = 0.0) -> list[str]:
    """The flags that would take more off the GPU, the largest saving first, for a run with ``args``;
    ``kept_gib``: optimizer state the offloaders kept on the GPU when memory ran out."""
    long = (getattr(args, "seq_length", 0) or 0) * (getattr(args, "micro_batch_size", 1) or 1) >= LONG
    full = getattr(args, "recompute_granularity", None) == "full"
    advice = []
    if kept_gib > 0 and getattr(args, "offload_prefetch", None) != "step":
        advice.append(f"--offload-prefetch step ({kept_gib:.2f} GiB of optimizer state was kept on the GPU)")
    if long and not uses_sdpa_spec(args) and getattr(args, "transformer_impl", "local") == "local":
        advice.append(f"--spec {' '.join(SDPA_SPEC)} (attention without [s, s] scores)")
    if not on(args, "offload_optimizer_states"):
        advice.append("--offload-optimizer-states")
    elif not on(args, "offload_weights"):
        advice.append("--offload-weights (with full recompute one layer at a time)")
    if not full:
        advice.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    elif long and not on(args, "offload_layer_inputs"):
        advice.append("--offload-layer-inputs")
    if long and not on(args, "chunked_loss") and not over_one(args, "tensor_model_parallel_size"):
        advice.append("--chunked-loss")
    if not advice and over_one(args, "micro_batch_size"):
        advice.append("a smaller --micro-batch-size (more micro-batches per step)")
    return advice


def out_of_memory_line(
    error: BaseException,
    args: argparse.Namespace | None,
    peak_reserved: int,
    gib: int,
    state_note: str | None = None,
    kept_bytes: int = 0,
) -> str:
    """The line to print for ``error`` (a ``torch.OutOfMemoryError``); ``peak_reserved`` in bytes;
    ``state_note``: the scheduler's numbers where the whole optimizer state was in host memory already;
    ``kept_bytes``: optimizer state kept on the GPU then."""
    asked = _ASKED.search(str(error))
    cap = getattr(args, "offload_gpu_memory_cap_gib", None) if args is not None else None
    held = f"{peak_reserved / gib:.2f} GiB reserved at the peak"
    where = f"under --offload-gpu-memory-cap-gib {cap:g}" if cap else "on this GPU"
    # Megatron-LM's loop sets curr_iteration to the iterations done before each train_step.
    done = getattr(args, "curr_iteration", None) if args is not None else None
    phase = raised_in(error, done + 1 if isinstance(done, int) else None)
    where += f", {phase}" if phase else ""
    asked_text = f"{asked.group(1)} {asked.group(2)}iB" if asked else "more"
    line = f"megatron-offload: out of GPU memory {where}: " + (state_note or f"asked for {asked_text} with {held}")
    advice = what_to_add(args, kept_bytes / gib) if args is not None else []
    if advice:
        return f"{line}. To move more off the GPU, add: {'; '.join(advice)}"
    return f"{line}. Every offload this run can use is on: raise the cap or use a larger GPU"


def line_for(error: BaseException) -> str:
    """The line for ``error`` in Megatron-LM's loop: the flags it ran with, the peak, and, where every
    attached offloader had the whole state in host memory, what training needs without it."""
    import torch

    from megatron_offload.core.gpu_memory import gpu_only
    from megatron_offload.core.units import GIB
    from megatron_offload.megatron.training_hooks import attached_handles, parsed_megatron_args

    peak = gpu_only(torch.cuda.max_memory_reserved())
    handles = attached_handles()
    notes = [handle.smallest_footprint_note(peak, asked_bytes(error)) for handle in handles]
    note = notes[0] if notes and all(notes) else None
    kept = sum(handle.kept_bytes() for handle in handles)
    return out_of_memory_line(error, parsed_megatron_args(), peak, GIB, note, kept)
