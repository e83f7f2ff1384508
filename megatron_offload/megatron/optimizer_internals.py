"""Every reach into megatron-core's optimizer internals lives here; optimizer_adapter.py wires them.

Checked against megatron-core 0.16.1 and 0.19.2 (see README for what ran on a GPU). What we rely on:
- ``ChainedOptimizer.chained_optimizers``; ``DistributedOptimizer.optimizer`` (the inner Adam),
  ``.config`` (its OptimizerConfig), ``.model_chunks`` (each with ``.config``, the TransformerConfig
  whose ``finalize_model_grads_func`` the schedules call after backward) and
  ``.shard_fp32_from_float16_groups`` (fp32 masters with storage of their own). ``shard_fp32_groups``
  and ``shard_float16_groups`` are views into the DDP buffers and are never freed.
- ``MegatronOptimizer.step()`` runs grad preparation, then ``step_with_ready_grads()`` (the inner Adam
  step and the master-to-model copy), and returns early without it when the step is skipped.
- With ``use_precision_aware_optimizer`` TransformerEngine's FusedAdam keeps the masters in its own
  state under ``master_param``; the engine finds them there.
- The streamed step: ``step_with_ready_grads`` calls the inner ``optimizer.step()`` and then
  ``_copy_main_params_to_model_params()``, which reads ``shard_fp32_from_float16_groups`` /
  ``model_float16_groups`` and ``shard_fp32_groups`` / ``model_fp32_groups`` pairwise. We replace the
  inner step by the engine's chunked one and run that copy per chunk on group lists cut to the chunk.
  Before the step, ``_copy_model_grads_to_main_grads`` assigns each master's ``.grad``.
- The last micro-batch: DDP's ``no_sync()`` clears ``is_last_microbatch`` on every bucket group
  (``bucket_groups`` and ``expert_parallel_bucket_groups``) and sets it again for the last backward,
  in every schedule, pipeline-parallel ones included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import torch
from packaging.version import Version

from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader
from megatron_offload.optimizer_state.share_out import StepWindow
from megatron_offload.optimizer_state.staging_ring import Staging

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


def _streamed_step_supported(dist_opt: Any) -> bool:
    """The streamed step copies masters into the model per chunk with megatron-core's own copy; its
    fp8/fp4/FSDP branches work on all params at once, so those setups bring the state back whole."""
    ddp_config = getattr(dist_opt, "ddp_config", None)
    return not (
        ddp_config is None
        or getattr(ddp_config, "use_megatron_fsdp", False)
        or getattr(ddp_config, "fp8_param_gather", False)
        or getattr(ddp_config, "fp4_param_gather", False)
        or getattr(dist_opt.config, "reuse_grad_buf_for_mxfp8_param_ag", False)
        or not hasattr(dist_opt, "_copy_main_params_to_model_params")
    )


def _cut_to(shard_groups: list[list[Any]], model_groups: list[list[Any]], wanted: set[int]) -> tuple[list, list]:
    """The (shard, model) group lists restricted to the shards in ``wanted``, pairs kept together."""
    shards, models = [], []
    for shard_group, model_group in zip(shard_groups, model_groups, strict=True):
        pairs = [(shard, model) for shard, model in zip(shard_group, model_group, strict=True) if id(shard) in wanted]
        shards.append([shard for shard, _ in pairs])
        models.append([model for _, model in pairs])
    return shards, models


class _StreamedStep:
    """Replaces a DistributedOptimizer's inner Adam ``step``: runs the engine's chunked step, copying
    each chunk's masters into the model while they are on the GPU, and makes megatron-core's own
    copy of all masters, which follows, a no-op for that step."""

    GROUP_LISTS = ("shard_fp32_from_float16_groups", "model_float16_groups", "shard_fp32_groups", "model_fp32_groups")

    def __init__(
        self,
        dist_opt: Any,
        offloader: OptimizerStateOffloader,
        on_start: Callable[[], None],
        forward_hides: Callable[[], int],
        link_out: Callable[[], float],
    ) -> None:
        self.dist_opt = dist_opt
        self.offloader = offloader
        self.on_start = on_start
        self.forward_hides = forward_hides  # OffloadHandle.forward_hides, read at each step
        self.window = StepWindow(offloader.streams, link_out)  # learned at each step, bounds the next's copies out
        self.stepper = ChunkStepper(dist_opt.optimizer)
        self.copy_all = dist_opt._copy_main_params_to_model_params
        self.copied = False
        self.stage: streamed_step.Stage | None = None  # set where masters and gradients live in host memory
        self.staging: Staging | None = None  # taken as the optimizer's step began (begin_staging), for its update
        self._cuts: dict[tuple[int, ...], dict[str, list]] = {}  # group lists cut to a chunk, made once

    def begin_staging(self) -> None:
        """As megatron-core's step begins: start the streamed chunks' copies in, to run beside its work ahead of
        the update. Not with a stage (its own copies are ordered with the update's), nor where the update will
        not stream (the plan does not match the state: the whole step then)."""
        if self.stage is None:
            self.staging = streamed_step.begin_staging(self.offloader)

    def drop_staging(self) -> None:
        """The step has ended (or megatron-core skipped the update): what was staged leaves with the rest."""
        self.staging = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.on_start()
        try:
            hides = self.forward_hides()
            streamed_step.run(
                self.offloader,
                self.stepper,
                self.copy_chunk_to_model,
                self.stage,
                forward_hides=hides,
                window=self.window,
                staging=self.staging,
            )
        finally:
            self.staging = None
            if self.stage is not None:
                self.stage.end_step()
        self.copied = True

    def copy_chunk_to_model(self, params: Sequence[torch.Tensor]) -> None:
        """megatron-core's own master-to-model copy, on its group lists cut to these params."""
        key = tuple(id(param) for param in params)
        cut = self._cuts.get(key)
        if cut is None:
            wanted = set(key)
            cut = dict(
                zip(
                    self.GROUP_LISTS[:2],
                    _cut_to(self.dist_opt.shard_fp32_from_float16_groups, self.dist_opt.model_float16_groups, wanted),
                    strict=True,
                )
            )
            cut.update(
                zip(
                    self.GROUP_LISTS[2:],
                    _cut_to(self.dist_opt.shard_fp32_groups, self.dist_opt.model_fp32_groups, wanted),
                    strict=True,
                )
            )
            self._cuts[key] = cut
        saved = {name: getattr(self.dist_opt, name) for name in self.GROUP_LISTS}
        try:
            for name, value in cut.items():
                setattr(self.dist_opt, name, value)
            self.copy_all()
        finally:
            for name, value in saved.items():
                setattr(self.dist_opt, name, value)

    def copy_main_params_to_model_params(self, *args: Any, **kwargs: Any) -> Any:
        if self.copied:  # done chunk by chunk inside the step
            self.copied = False
            return None
        return self.copy_all(*args, **kwargs)


def streamed_step_of(dist_opt: Any) -> _StreamedStep | None:
    """The streamed step attach_offloader put in place of ``dist_opt``'s inner Adam step, if any."""
    step = vars(dist_opt.optimizer).get("step")
    owner = getattr(step, "__self__", None)
    return owner if isinstance(owner, _StreamedStep) else None


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
