"""The streamed step's reaches into megatron-core's DistributedOptimizer; optimizer_adapter.py wires them.

Checked against the megatron-core versions that optimizer_internals.py names (CHECKED_MEGATRON_CORE_VERSIONS)
and checks at attach; that module holds every other reach into the optimizer. What is relied on here:
- ``step_with_ready_grads`` (DistributedOptimizer's) calls the inner ``optimizer.step()`` and then
  ``_copy_main_params_to_model_params()``, which reads ``shard_fp32_from_float16_groups`` /
  ``model_float16_groups`` and ``shard_fp32_groups`` / ``model_fp32_groups`` pairwise. We replace the
  inner step by the engine's chunked one and run that copy per chunk on group lists cut to the chunk.
  Before the step, ``_copy_model_grads_to_main_grads`` assigns each master's ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader
from megatron_offload.optimizer_state.staging_ring import Staging

__all__ = ["STEP_RANGE", "streamed_step_of"]

# The streamed step's range in a profiler trace: named as torch's optimizers name theirs ("Optimizer.step#AdamW.step"),
# so that tools reading a trace for the optimizer's step (benchmarks/step_link.py) find it either way.
STEP_RANGE = "Optimizer.step#StreamedStep.step"


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
    ) -> None:
        self.dist_opt = dist_opt
        self.offloader = offloader
        self.on_start = on_start
        self.forward_hides = forward_hides  # OffloadHandle.forward_hides, read at each step
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
            with torch.profiler.record_function(STEP_RANGE):
                streamed_step.run(
                    self.offloader,
                    self.stepper,
                    self.copy_chunk_to_model,
                    self.stage,
                    forward_hides=hides,
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
