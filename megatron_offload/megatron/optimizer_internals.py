"""Every reach into megatron-core's optimizer internals lives here, but the streamed step's (in
streamed_step_internals.py); optimizer_adapter.py wires them.

Checked against megatron-core 0.16.1 and 0.19.2, both modules (see README for what ran on a GPU). What we rely on:
- ``ChainedOptimizer.chained_optimizers``; ``DistributedOptimizer.optimizer`` (the inner Adam),
  ``.config`` (its OptimizerConfig), ``.model_chunks`` (each with ``.config``, the TransformerConfig
  whose ``finalize_model_grads_func`` the schedules call after backward) and
  ``.shard_fp32_from_float16_groups`` (fp32 masters with storage of their own). ``shard_fp32_groups``
  and ``shard_float16_groups`` are views into the DDP buffers and are never freed.
- ``MegatronOptimizer.step()`` runs grad preparation, then ``step_with_ready_grads()`` (the inner Adam
  step and the master-to-model copy), and returns early without it when the step is skipped.
- With ``use_precision_aware_optimizer`` TransformerEngine's FusedAdam keeps the masters in its own
  state under ``master_param``; the engine finds them there.
- The last micro-batch: DDP's ``no_sync()`` clears ``is_last_microbatch`` on every bucket group
  (``bucket_groups`` and ``expert_parallel_bucket_groups``) and sets it again for the last backward,
  in every schedule, pipeline-parallel ones included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

from packaging.version import Version

from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader

logger = logging.getLogger(__name__)

__all__ = ["CHECKED_MEGATRON_CORE_VERSIONS", "STATE_ACCESS_METHODS", "distributed_optimizers"]

CHECKED_MEGATRON_CORE_VERSIONS = ("0.16.1", "0.19.2")
SUPPORTED_RANGE = (Version("0.14"), Version("0.20"))
_HANDLE_ATTR = "_megatron_offload_handle"
_saving: set[int] = set()  # id() of each offloader whose sharded_state_dict is building a save right now

# DistributedOptimizer methods that read or write optimizer state outside step() (checkpointing,
# reloading masters from the model, megatron-core's own offload_to_cpu). The state is brought back to
# the GPU before each; it stays there until the next step ends, so a host copy is never older than
# what a load wrote. The one exception is building the sharded state dict for a save: offloaded
# tensors hold their values in host memory, so the save reads them there, with no GPU copy. Names
# missing from a version are skipped.
STATE_ACCESS_METHODS = (
    "state_dict",
    "load_state_dict",
    "save_parameter_state",
    "load_parameter_state",
    "get_parameter_state_dp_zero",
    "get_parameter_state_dp_reshardable",
    "load_parameter_state_from_dp_zero",
    "reload_model_params",
    "offload_to_cpu",
)


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The DistributedOptimizers in ``optimizer`` (itself one, or a ChainedOptimizer of them)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        return [optimizer]
    found = [opt for inner in getattr(optimizer, "chained_optimizers", []) for opt in distributed_optimizers(inner)]
    if not found:
        raise TypeError(
            f"expected megatron-core's DistributedOptimizer (or a ChainedOptimizer of them), got "
            f"{type(optimizer).__name__}: build the optimizer with get_megatron_optimizer and "
            "OptimizerConfig(use_distributed_optimizer=True) (--use-distributed-optimizer in Megatron-LM)."
        )
    return found


def _check_compatible(dist_opt: Any) -> None:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if getattr(dist_opt.config, "offload_optimizer_states", False) or getattr(
        dist_opt.config, "chunked_optimizer_state_offload", False
    ):
        raise ValueError(
            "this megatron-core has its own optimizer-state offloading switched on "
            "(OptimizerConfig.offload_optimizer_states / Megatron-LM's --offload-optimizer-states). Two "
            "offloaders would fight over the same tensors: switch megatron-core's off or do not attach ours."
        )
    if isinstance(dist_opt.optimizer, HybridDeviceOptimizer) or getattr(
        dist_opt.config, "optimizer_cpu_offload", False
    ):
        raise ValueError(
            "this optimizer runs Adam on the CPU (megatron-core's HybridDeviceOptimizer, "
            "OptimizerConfig(optimizer_cpu_offload=True), --optimizer-cpu-offload in Megatron-LM); offloading "
            "keeps Adam on the GPU and parks its state in host memory. Build the optimizer without "
            "optimizer_cpu_offload, or do not attach."
        )


def _in_last_microbatch(model_chunks: Sequence[Any]) -> bool:
    for chunk in model_chunks:
        groups = getattr(chunk, "bucket_groups", []) + getattr(chunk, "expert_parallel_bucket_groups", [])
        if not all(getattr(group, "is_last_microbatch", True) for group in groups):
            return False
    return True


def _master_weights(dist_opt: Any) -> list[Any]:
    """fp32 masters held outside the Adam state (empty when TE's FusedAdam holds them)."""
    return [t for group in dist_opt.shard_fp32_from_float16_groups for t in group if t is not None]


def _check_version() -> str:
    installed = version("megatron-core")
    low, high = SUPPORTED_RANGE
    if not low <= Version(installed) < high:
        logger.warning(
            "megatron-offload was checked against megatron-core %s; %s is installed and may differ.",
            ", ".join(CHECKED_MEGATRON_CORE_VERSIONS),
            installed,
        )
    return installed


def _after_wait(method: Callable[..., Any], offloader: OptimizerStateOffloader, replaces: bool) -> Callable[..., Any]:
    """The state back on the GPU before ``method`` reads or writes it; after a load (``replaces``), the
    state's tensors may be new ones, so the next step plans afresh."""

    def wait_then_call(*args: Any, **kwargs: Any) -> Any:
        if id(offloader) not in _saving:  # inside a save, reads are served from host memory
            offloader.wait()
        try:
            return method(*args, **kwargs)
        finally:
            if replaces:
                offloader.state.replaced()

    return wait_then_call


def _save_from_host(sharded_state_dict: Callable[..., Any], offloader: OptimizerStateOffloader) -> Callable[..., Any]:
    """For a save, let megatron-core read offloaded state from host memory; for a load, bring it back."""

    def sharded_state_dict_from_host(*args: Any, **kwargs: Any) -> Any:
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading:
            offloader.wait()
            return sharded_state_dict(*args, **kwargs)
        offloader.copies.drain()
        # megatron-core calls state_dict() and get_parameter_state_*() from here: let them read the host copies.
        _saving.add(id(offloader))
        try:
            return sharded_state_dict(*args, **kwargs)
        finally:
            _saving.discard(id(offloader))

    return sharded_state_dict_from_host
