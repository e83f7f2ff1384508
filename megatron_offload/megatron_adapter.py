"""Every touch of megatron-core internals lives here.

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields, replace
from importlib.metadata import version
from typing import Any

from packaging.version import Version

from megatron_offload.config import OffloadConfig, PrefetchPolicy
from megatron_offload.engine import OffloadStats, OptimizerStateOffloader

logger = logging.getLogger(__name__)

__all__ = ["CHECKED_MEGATRON_CORE_VERSIONS", "OffloadHandle", "attach_offloader"]

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
            f"--offload-optimizer-states found no megatron-core DistributedOptimizer in {type(optimizer).__name__}; "
            "build the optimizer with --use-distributed-optimizer (OptimizerConfig(use_distributed_optimizer=True))."
        )
    return found


def _check_compatible(dist_opt: Any) -> None:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if getattr(dist_opt.config, "offload_optimizer_states", False):
        raise ValueError(
            "this megatron-core has its own optimizer-state offloading switched on "
            "(OptimizerConfig.offload_optimizer_states / Megatron-LM's --offload-optimizer-states). Two "
            "offloaders would fight over the same tensors: switch megatron-core's off or do not attach ours."
        )
    if isinstance(dist_opt.optimizer, HybridDeviceOptimizer) or getattr(
        dist_opt.config, "optimizer_cpu_offload", False
    ):
        raise ValueError(
            "--offload-optimizer-states cannot be combined with --optimizer-cpu-offload: that runs Adam on the "
            "CPU (HybridDeviceOptimizer), ours keeps Adam on the GPU and parks its state in host memory. "
            "Remove one of the two flags."
        )


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


class _PrefetchOnFinalize:
    """Wraps a TransformerConfig's ``finalize_model_grads_func``: starts the copy back, then finalizes,
    so the copy overlaps the gradient reduction. Keeps whatever function was there."""

    def __init__(self, inner: Callable[..., Any], handle: OffloadHandle) -> None:
        self.inner = inner
        self.handle = handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.handle.prefetch()
        return self.inner(*args, **kwargs)


class OffloadHandle:
    """What ``attach_offloader`` returns: the offloaders, their telemetry, and ``detach()``."""

    def __init__(self, optimizer: Any, config: OffloadConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self.offloaders: list[OptimizerStateOffloader] = []
        self._wrapped: list[tuple[Any, str, Any]] = []  # (object, attribute, what was there before)

    def prefetch(self) -> None:
        for offloader in self.offloaders:
            offloader.prefetch()

    def wait(self) -> None:
        for offloader in self.offloaders:
            offloader.wait()

    def offload(self) -> None:
        for offloader in self.offloaders:
            offloader.offload()

    def read_stats(self) -> OffloadStats:
        """Totals over every DistributedOptimizer on this rank."""
        total = OffloadStats()
        for offloader in self.offloaders:
            stats = offloader.read_stats()
            for field in fields(OffloadStats):
                value = getattr(stats, field.name)
                if field.name == "pinned":
                    total.pinned = total.pinned and value
                elif field.name.startswith("last_") or field.name in ("offloads", "prefetches"):
                    setattr(total, field.name, max(getattr(total, field.name), value))
                else:
                    setattr(total, field.name, getattr(total, field.name) + value)
        return total

    def detach(self) -> None:
        """Bring all state back to the GPU and undo every wrapper. Safe to call twice."""
        for obj, name, before in reversed(self._wrapped):
            if name == "finalize_model_grads_func":
                if isinstance(obj.finalize_model_grads_func, _PrefetchOnFinalize):
                    obj.finalize_model_grads_func = obj.finalize_model_grads_func.inner
            elif before is None:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)
        self._wrapped.clear()
        for offloader in self.offloaders:
            offloader.restore()
        self.offloaders.clear()
        if getattr(self.optimizer, _HANDLE_ATTR, None) is self:
            delattr(self.optimizer, _HANDLE_ATTR)

    # ---------------------------------------------------------------------------------- wiring
    def _wrap_method(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        before = vars(obj).get(name)
        setattr(obj, name, make(getattr(obj, name)))
        self._wrapped.append((obj, name, before))

    def _install_finalize_hooks(self) -> None:
        """(Re)wrap each model config's finalize function. Training loops often set it after the
        optimizer is built, so this runs again after every step; it never wraps twice."""
        if self.config.prefetch is not PrefetchPolicy.FINALIZE:
            return
        for dist_opt in distributed_optimizers(self.optimizer):
            for chunk in dist_opt.model_chunks:
                model_config = chunk.config
                current = model_config.finalize_model_grads_func
                if current is None or isinstance(current, _PrefetchOnFinalize):
                    continue
                model_config.finalize_model_grads_func = _PrefetchOnFinalize(current, self)
                if not any(obj is model_config for obj, _, _ in self._wrapped):
                    self._wrapped.append((model_config, "finalize_model_grads_func", None))

    def _step_wrapper(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def step_with_offload(*args: Any, **kwargs: Any) -> Any:
            self.prefetch()  # no-op when a prefetch from finalize is already in flight
            try:
                return step(*args, **kwargs)
            finally:
                # Successful, skipped or failed: the state leaves in one piece, never half-way.
                self.offload()
                self._install_finalize_hooks()

        return step_with_offload


def attach_offloader(optimizer: Any, config: OffloadConfig | None = None, **overrides: Any) -> OffloadHandle:
    """Offload the Adam state (and fp32 masters) of ``optimizer`` between steps.

    ``optimizer`` is what megatron-core's ``get_megatron_optimizer`` returned: a DistributedOptimizer or a
    ChainedOptimizer of them. Keyword overrides are OffloadConfig fields. Returns a handle; call
    ``handle.detach()`` to stop offloading and bring the state back.
    """
    config = replace(config or OffloadConfig(), **overrides)
    if getattr(optimizer, _HANDLE_ATTR, None) is not None:
        raise RuntimeError("an offloader is already attached to this optimizer; call detach() on it first")
    megatron_core_version = _check_version()
    dist_opts = distributed_optimizers(optimizer)
    for dist_opt in dist_opts:
        _check_compatible(dist_opt)

    handle = OffloadHandle(optimizer, config)
    for dist_opt in dist_opts:
        masters = _master_weights(dist_opt) if config.offload_master_weights else []
        keep = () if config.offload_master_weights else ("master_param",)
        offloader = OptimizerStateOffloader(
            dist_opt.optimizer,
            masters,
            keep_state_keys=keep,
            pin_memory=config.pin_memory,
            check_host_memory=config.check_host_memory,
        )
        handle.offloaders.append(offloader)
        # The inner Adam step, and anything else that reads the state, must see the copied-back values.
        for name in ("step_with_ready_grads", *STATE_ACCESS_METHODS):
            if hasattr(dist_opt, name):
                handle._wrap_method(dist_opt, name, lambda inner, o=offloader: _after_wait(inner, o))
        handle._wrap_method(dist_opt, "sharded_state_dict", lambda inner, o=offloader: _save_from_host(inner, o))
    handle._wrap_method(optimizer, "step", handle._step_wrapper)
    handle._install_finalize_hooks()
    setattr(optimizer, _HANDLE_ATTR, handle)
    logger.info(
        "megatron-offload attached to %d DistributedOptimizer(s) (megatron-core %s, %s)",
        len(dist_opts),
        megatron_core_version,
        config,
    )
    return handle


def _after_wait(method: Callable[..., Any], offloader: OptimizerStateOffloader) -> Callable[..., Any]:
    def wait_then_call(*args: Any, **kwargs: Any) -> Any:
        if id(offloader) not in _saving:  # inside a save, reads are served from host memory
            offloader.wait()
        return method(*args, **kwargs)

    return wait_then_call


def _save_from_host(sharded_state_dict: Callable[..., Any], offloader: OptimizerStateOffloader) -> Callable[..., Any]:
    """For a save, let megatron-core read offloaded state from host memory; for a load, bring it back."""

    def sharded_state_dict_from_host(*args: Any, **kwargs: Any) -> Any:
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading:
            offloader.wait()
            return sharded_state_dict(*args, **kwargs)
        offloader.host_copies_ready()
        # megatron-core calls state_dict() and get_parameter_state_*() from here: let them read the host copies.
        _saving.add(id(offloader))
        try:
            return sharded_state_dict(*args, **kwargs)
        finally:
            _saving.discard(id(offloader))

    return sharded_state_dict_from_host
