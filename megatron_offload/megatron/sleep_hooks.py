"""Sleep and wake for megatron-core training: every touch of megatron-core internals it needs, but for
the DDP chunks' bucket groups and the guards a sleep puts on them (ddp_chunks.py).

This module may import megatron_adapter (the offloading side); megatron_adapter never imports this one.
Of an attached handle it reads ``offloaders`` and ``in_step`` only.

Checked against megatron-core 0.16.1 and 0.19.2. What we rely on:
- DDP model chunks' ``buffers`` and ``expert_parallel_buffers`` (``_ParamAndGradBuffer``), each with
  ``.grad_data`` and, with the distributed optimizer, ``.param_data``: one flat tensor per buffer that
  ``param.data``, ``param.main_grad`` and the bucket views look into. Freeing its storage with
  ``untyped_storage().resize_(0)`` keeps those views valid (megatron-core's own ``offload_grad_buffers``
  does the same); growing it back and copying the bytes makes them see the same values again.
- ChainedOptimizer's ``chained_optimizers``, DistributedOptimizer's ``.optimizer`` (inner Adam),
  ``.model_chunks`` and ``shard_fp32_from_float16_groups`` (through megatron_adapter).
- Megatron-LM's RL loop (``--rl-offload-optimizer-during-inference``) calls ``optimizer.offload_to_cpu()``
  before the rollout and ``optimizer.restore_from_cpu()`` after it, on the optimizer that
  ``training.get_megatron_optimizer`` returned, and frees the gradient buffers itself through DDP's
  ``offload_grad_buffers()`` / ``restore_grad_buffers()`` (no copy: they are zeroed at the next step).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from megatron_offload.config.flags import offload_requested
from megatron_offload.core.gpu_memory import expandable_segments_from_now
from megatron_offload.megatron.ddp_chunks import Unset, ddp_buffers, in_flight, refuse_forward, refuse_zero_grad
from megatron_offload.megatron.optimizer_internals import _HANDLE_ATTR, _master_weights, distributed_optimizers
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader
from megatron_offload.sleep.report import SleepError, SleepReport
from megatron_offload.sleep.sleeper import DEFAULT_CHUNK_BYTES, Sleeper

logger = logging.getLogger(__name__)

__all__ = ["MegatronSleeper", "install_rl_sleep_hooks", "route_rl_offload_through_sleep", "sleep_wake_for"]

_SLEEPER_ATTR = "_megatron_offload_sleeper"
OPTIMIZER, GRADS, PARAMS = "optimizer", "grads", "params"


class MegatronSleeper:
    """Sleep and wake for one megatron-core optimizer and its DDP model chunks (see ``sleep_wake_for``)."""

    def __init__(self, optimizer: Any, model_chunks: Sequence[Any], *, chunk_bytes: int, pin_memory: bool) -> None:
        self.optimizer = optimizer
        self.model_chunks = list(model_chunks)
        handle = getattr(optimizer, _HANDLE_ATTR, None)
        self.handle = handle
        if handle is not None:  # --offload-optimizer-states: the state already lives on the host between steps
            offloaders = list(handle.offloaders)
        else:  # ours, kept for reuse; prepare() or the first sleep pins their slab, after a host-memory check
            offloaders = [
                OptimizerStateOffloader(
                    d.optimizer,
                    _master_weights(d),
                    # Large chunks: few copies, and blocks large enough that the allocator gives back all
                    # but their edges when a sleep frees them.
                    chunk_bytes=chunk_bytes,
                    pin_memory=pin_memory,
                    check_host_memory=False,
                )
                for d in distributed_optimizers(optimizer)
            ]
        buffers = ddp_buffers(self.model_chunks)
        grads = [b.grad_data for b in buffers if b.grad_data is not None]
        grad_storages = {g.untyped_storage().data_ptr() for g in grads}
        # A param buffer that shares the grad buffer's storage (MXFP8) moves with the grads.
        params = [
            b.param_data
            for b in buffers
            if b.param_data is not None and b.param_data.untyped_storage().data_ptr() not in grad_storages
        ]
        self._has_param_buffers = bool(buffers) and all(b.param_data is not None for b in buffers)
        self.sleeper = Sleeper(
            offloaders,
            {GRADS: grads, PARAMS: params},
            state_lives_on_host=handle is not None,
            busy=self._busy,
            chunk_bytes=chunk_bytes,
            pin_memory=pin_memory,
        )
        # Memory goes back to the device only from allocator segments with nothing live left in them; with
        # expandable segments that is page by page. The buffers and state blocks that wakes allocate from
        # now on land in them (as with attach_offloader; the user's PYTORCH_CUDA_ALLOC_CONF stands).
        allocator_note = expandable_segments_from_now()
        if allocator_note:
            logger.warning(allocator_note)
        self._stepping = False
        self._guards: list[Any] = []  # removed at wake: forward hooks, instance attributes
        self._step_before = vars(optimizer).get("step")  # an attached handle's wrapper, or None
        optimizer.step = self._guarded(optimizer.step)

    def _busy(self) -> str | None:
        if self._stepping or getattr(self.handle, "in_step", False):
            return "in the middle of optimizer.step()"
        return in_flight(self.model_chunks)

    def _guarded(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def step_when_awake(*args: Any, **kwargs: Any) -> Any:
            if self.sleeper.is_asleep:
                raise SleepError(f"optimizer.step() while {', '.join(self.sleeper.asleep)} sleep: call wake() first")
            self._stepping = True
            try:
                return step(*args, **kwargs)
            finally:
                self._stepping = False

        return step_when_awake

    @property
    def is_asleep(self) -> bool:
        return self.sleeper.is_asleep

    def _parts(self, optimizer: bool, grads: bool, params: bool) -> list[str]:
        if params and not self._has_param_buffers:
            raise SleepError("params=True needs DDP param buffers: build with the distributed optimizer")
        return [name for name, wanted in ((OPTIMIZER, optimizer), (GRADS, grads), (PARAMS, params)) if wanted]

    def prepare(self, *, optimizer: bool = True, grads: bool = False, params: bool = False) -> SleepReport:
        """Pin the host memory that sleeping these parts needs, now, so that the first sleep runs at the
        link's speed (about 0.5 s per GiB; a progress line with GiB and GiB/s per slab on the first rank).
        Call it at setup, with the parts your sleeps will move. Nothing moves. With
        ``--offload-optimizer-states`` the optimizer part is already in the handle's slab: 0 bytes."""
        report = self.sleeper.prepare(self._parts(optimizer, grads, params))
        logger.info("megatron-offload: %s", report.describe())
        return report

    def sleep(self, *, optimizer: bool = True, grads: bool = False, params: bool = False) -> SleepReport:
        """Move the optimizer state and fp32 masters (and, if asked, the gradient and bf16 param
        buffers) to pinned host memory and give the device memory back. Between training steps only."""
        parts = self._parts(optimizer, grads, params)
        report = self.sleeper.sleep(parts)
        # Code that would touch freed memory fails with a sentence instead of a device fault.
        if params:
            self._guards += [c.register_forward_pre_hook(refuse_forward) for c in self.model_chunks]
        if grads or params:
            for chunk in self.model_chunks:  # the first thing a training step does (writes the grad buffer)
                chunk.zero_grad_buffer = refuse_zero_grad
                self._guards.append(Unset(chunk, "zero_grad_buffer"))
        logger.info("megatron-offload: asleep (%s): %s", ", ".join(parts), report.describe())
        return report

    def wake(self) -> SleepReport:
        """Bring back everything the last sleep moved, bitwise; the next step can run at once."""
        report = self.sleeper.wake()
        for guard in self._guards:
            guard.remove()
        self._guards = []
        logger.info("megatron-offload: awake: %s", report.describe())
        return report

    def close(self) -> None:
        """Wake if asleep, return the state to storage of its own, free the host slabs, unwrap step."""
        if self.is_asleep:
            self.wake()
        self.sleeper.close()
        if self._step_before is not None:
            self.optimizer.step = self._step_before
        else:
            vars(self.optimizer).pop("step", None)
        vars(self.optimizer).pop(_SLEEPER_ATTR, None)


def sleep_wake_for(
    optimizer: Any,
    model_chunks: Sequence[Any] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    pin_memory: bool = True,
) -> MegatronSleeper:
    """The sleep/wake object of a megatron-core optimizer (a DistributedOptimizer or a ChainedOptimizer
    of them), made on first call and reused. ``model_chunks`` default to the optimizer's own. Works with
    and without an attached offloader (``attach_offloader`` first if you use one). ``chunk_bytes`` is
    the size of the pieces that move; call ``prepare()`` on the result at setup."""
    existing = vars(optimizer).get(_SLEEPER_ATTR)
    if existing is not None:
        if existing.handle is not getattr(optimizer, _HANDLE_ATTR, None):
            raise SleepError(
                "an offloader was attached or detached since sleep_wake_for() was first called: call close() "
                "on the old sleeper (megatron_offload.sleep_wake_for(optimizer).close()) before attach/detach"
            )
        return existing
    if model_chunks is None:
        chunks = [c for d in distributed_optimizers(optimizer) for c in d.model_chunks]
        model_chunks = list({id(c): c for c in chunks}.values())
    sleeper = MegatronSleeper(optimizer, model_chunks, chunk_bytes=chunk_bytes, pin_memory=pin_memory)
    setattr(optimizer, _SLEEPER_ATTR, sleeper)
    return sleeper


def route_rl_offload_through_sleep(optimizer: Any, model_chunks: Sequence[Any] | None = None) -> MegatronSleeper:
    """Make ``optimizer.offload_to_cpu()`` / ``restore_from_cpu()`` (what Megatron-LM's RL loop calls)
    a sleep / wake of the optimizer state and masters. Like megatron-core's own, each is a no-op when
    there is nothing to move (already asleep, or awake). Gradient buffers stay with DDP's own
    ``offload_grad_buffers()``, which frees them without a copy."""
    sleeper = sleep_wake_for(optimizer, model_chunks)

    def offload_to_cpu(*args: Any, **kwargs: Any) -> None:
        if not sleeper.is_asleep:
            sleeper.sleep(optimizer=True)

    def restore_from_cpu(*args: Any, **kwargs: Any) -> None:
        if sleeper.is_asleep:
            sleeper.wake()

    optimizer.offload_to_cpu = offload_to_cpu
    optimizer.restore_from_cpu = restore_from_cpu
    return sleeper


def install_rl_sleep_hooks() -> None:
    """Hook megatron.training so that, with ``--rl-offload-optimizer-during-inference`` and
    ``--offload-optimizer-states``, the RL loop's optimizer offload goes through our sleep/wake
    (pinned, at the link's speed) instead of megatron-core's blocking copies to pageable memory.
    Call after ``install_training_hooks()``'s own wrapping (it wraps the optimizer that one returns)."""
    from megatron.training import global_vars, training

    build = training.get_megatron_optimizer
    if getattr(build, "_megatron_offload_rl", False):
        return

    def get_megatron_optimizer_with_rl_sleep(*args: Any, **kwargs: Any) -> Any:
        optimizer = build(*args, **kwargs)
        megatron_args = global_vars.get_args()
        rl = getattr(megatron_args, "rl_offload_optimizer_during_inference", False)
        if rl and offload_requested(megatron_args):
            model_chunks = kwargs.get("model_chunks", args[1] if len(args) > 1 else None)
            route_rl_offload_through_sleep(optimizer, model_chunks)
            if int(os.environ.get("RANK", "0")) == 0:
                print(
                    "megatron-offload: --rl-offload-optimizer-during-inference goes through megatron-offload's "
                    "sleep/wake (pinned host memory, link-speed copies) for the optimizer state and masters",
                    flush=True,
                )
        return optimizer

    get_megatron_optimizer_with_rl_sleep._megatron_offload_rl = True  # type: ignore[attr-defined]
    training.get_megatron_optimizer = get_megatron_optimizer_with_rl_sleep
