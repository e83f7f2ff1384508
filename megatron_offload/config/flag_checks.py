"""The offload flags taken together, once parsed: the combinations refused, and the flags that do nothing.

``check_offload_combinations`` reads only the flags as the user gave them, so the training hooks run it
before Megatron's own argument validation (and the launcher, before Megatron is imported at all);
``validate_offload_args`` runs after Megatron's, on what it derived. The weight and long-context flags have
their own checks beside their definitions (``check_weight_flags``, ``check_long_context_flags``, as tables of
refusals.py); these call them, so that one call checks every offload flag.
"""

from __future__ import annotations

import argparse

from megatron_offload.config.flags import DEFAULTS, UPSTREAM_FLAG, config_from_args, offload_requested
from megatron_offload.config.long_context_flags import check_long_context_flags
from megatron_offload.config.refusals import changed_flags
from megatron_offload.config.weight_flags import check_weight_flags

__all__ = ["check_offload_combinations", "ignored_offload_flags", "validate_offload_args"]


def check_offload_combinations(args: argparse.Namespace) -> None:
    """Raise ValueError for an offload value out of range (offloading on or off) or a flag that
    --offload-optimizer-states cannot be combined with.

    Reads only flags as the user gave them, none that Megatron derives, so it can run before Megatron's
    own validation: its assertions (such as --optimizer-cpu-offload's) would otherwise send the user the
    wrong way, and its argument dump would bury the message.
    """
    config_from_args(args)  # every offload value in range (the cap too), with the messages the Python API gives
    check_weight_flags(args, offload_requested(args))
    check_long_context_flags(args)
    if not offload_requested(args):
        return
    if getattr(args, "chunked_optimizer_state_offload", False) and getattr(
        args, "optimizer_state_offload_fraction", 1.0
    ):
        raise ValueError(
            f"--offload-optimizer-states cannot be combined with {UPSTREAM_FLAG}: both offload the same "
            "optimizer state, megatron-offload's offloader and Megatron-LM's own. Keep one: "
            f"--offload-optimizer-states for megatron-offload's, {UPSTREAM_FLAG} for Megatron-LM's."
        )
    if getattr(args, "optimizer_cpu_offload", False):
        raise ValueError(
            "--offload-optimizer-states cannot be combined with --optimizer-cpu-offload. "
            "--optimizer-cpu-offload (megatron-core's HybridDeviceOptimizer) moves the Adam update itself "
            "to the CPU; --offload-optimizer-states keeps the update on the GPU and only parks the state in "
            "host memory between steps. Both would own the same state: pick one (usually "
            "--offload-optimizer-states, which is much faster) and remove the other."
        )
    optimizer = getattr(args, "optimizer", "adam")
    if optimizer != "adam":
        raise ValueError(
            f"--offload-optimizer-states supports --optimizer adam only, got --optimizer {optimizer}. "
            "Use --optimizer adam or drop --offload-optimizer-states."
        )
    if getattr(args, "async_save", False):
        raise ValueError(
            "--offload-optimizer-states cannot be combined with --async-save: a checkpoint save reads the "
            "offloaded state straight from its host buffers, which the next step overwrites while an "
            "asynchronous save may still be writing them. Drop --async-save (saves are then synchronous)."
        )
    for flag in ("use_megatron_fsdp", "use_custom_fsdp", "use_torch_fsdp2", "optimizer_cuda_graph"):
        if getattr(args, flag, False):
            name = "--" + flag.replace("_", "-")
            why = (
                "the optimizer step is captured in a CUDA graph, whose memory addresses must not change"
                if flag == "optimizer_cuda_graph"
                else "FSDP shards and manages the optimizer state itself, outside DistributedOptimizer"
            )
            raise ValueError(
                f"--offload-optimizer-states cannot be combined with {name}: {why}. Remove one of the two."
            )
    # Megatron turns --use-distributed-optimizer on by itself only with Megatron-FSDP, refused above; it
    # may turn it off (--freeze-all-layers), which validate_offload_args checks after Megatron's validation.
    _require_distributed_optimizer(args)


def _require_distributed_optimizer(args: argparse.Namespace) -> None:
    if offload_requested(args) and not getattr(args, "use_distributed_optimizer", False):
        raise ValueError(
            "--offload-optimizer-states needs --use-distributed-optimizer: it offloads the state of "
            "megatron-core's DistributedOptimizer. Add --use-distributed-optimizer."
        )


def validate_offload_args(args: argparse.Namespace) -> None:
    """Raise ValueError, naming the flags and what to do, if the offload flags are out of range or
    combined with flags they cannot work with.

    Reads Megatron-LM's argument names; a name absent from ``args`` counts as its default. Runs inside
    Megatron's argument validation, so bad values fail before anything is built.
    """
    check_offload_combinations(args)
    _require_distributed_optimizer(args)  # again: Megatron's validation may have turned it off
    check_weight_flags(args, offload_requested(args), derived=True)


def ignored_offload_flags(args: argparse.Namespace) -> list[str]:
    """The offload flags given a value other than their default while offloading is off: they do
    nothing then, which the user may not expect (the GPU memory cap works either way)."""
    if offload_requested(args):
        return []
    defaults = {
        "offload_master_weights": DEFAULTS.offload_master_weights,
        "offload_prefetch": DEFAULTS.prefetch.value,
        "offload_chunk_mb": DEFAULTS.chunk_mb,
        "offload_fraction": DEFAULTS.fraction,
        "offload_host_memory_check": DEFAULTS.check_host_memory,
    }
    return changed_flags(args, defaults)
