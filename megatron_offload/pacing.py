"""Memory-paced hooks of the training loop: when state may come back during backward, and when the
forward must wait for copies out. Both read the caching allocator's figures from hooks, and learn
their margins from earlier iterations. They know nothing of Megatron: the adapter hands them the
model chunks, the handle and how to tell the last micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from megatron_offload.engine import OptimizerStateOffloader
from megatron_offload.gpu_memory import memory_limit_bytes

__all__ = ["PrefetchDuringBackward", "RoomForForward"]

MIB = 1024**2
# Least room kept free under the level backward started from when bringing state back during
# backward (see PrefetchDuringBackward for the learned margin).
PACING_MIN_MARGIN_BYTES = 64 * MIB
PACING_SAMPLES = 64  # memory readings per backward
# Least room kept free for what the forward allocates between two of its hooks while copies out drain.
FORWARD_MIN_MARGIN_BYTES = 256 * MIB


class Handle(Protocol):
    """What the hooks need of an OffloadHandle."""

    offloaders: list[OptimizerStateOffloader]

    def pending_out_bytes(self) -> int: ...

    def drain_out(self, nbytes: int | None = None) -> None: ...


class PrefetchDuringBackward:
    """Brings state back during the last micro-batch's backward, only into memory that backward has
    freed, so the peak does not rise. Driven by gradient-ready hooks.

    What is allocated plus what we brought back must stay under the level backward started from (the
    end of the forward), twice over:
    - during backward, less a margin for backward's temporaries, which come and go between two hooks
      where no reading sees them. The margin is learned: twice the most memory freed between two
      readings (one layer's saved activations; backward's temporaries were measured at 1.5 times that
      with unfused attention);
    - at the step, where what we brought back is still there when the step makes its own tensors
      (megatron-core's fp32 copies of bf16 gradients, Adam's temporaries, the streamed step's
      staging chunks): what the step holds when it starts is learned too, and its extra is bounded.
    Both are learned over earlier iterations; the first one that samples only learns.
    NOTE: which backward is the last is counted, not read from DDP's ``is_last_microbatch``: Megatron-LM
    installs ``no_sync`` only with --overlap-grad-reduce, so without it that flag is always set. The
    first iteration counts the backwards (the firings of the param whose gradient comes first).
    """

    def __init__(
        self, handle: Handle, model_chunks: Sequence[torch.nn.Module], in_last_microbatch: Callable[[], bool]
    ) -> None:
        self.handle = handle
        self.model_chunks = list(model_chunks)
        self.in_last_microbatch = in_last_microbatch
        self.level = 0  # highest reading of this backward, without what we brought back
        self.previous: int | None = None  # the last reading, without what we brought back
        self.brought = 0  # bytes brought back during this backward
        self.largest_drop = 0  # most memory freed between two readings, over all backwards so far
        self.margin: int | None = None  # None until one backward has been seen
        self.at_step: int | None = None  # most memory held when a step starts, without what we brought
        self.step_started = False
        self.step_extra = 0  # what the step adds on top (see OptimizerStateOffloader.step_footprint)
        self.calls = 0
        self.every = 1
        self.first_param: int | None = None  # id of the param whose gradient is ready first in a backward
        self.backwards = 0  # backwards begun in this iteration
        self.backwards_per_iteration: int | None = None
        params = {id(p): p for chunk in self.model_chunks for p in chunk.parameters() if p.requires_grad}
        self.hooks = [param.register_post_accumulate_grad_hook(self.on_grad_ready) for param in params.values()]
        self.on_gpu = torch.cuda.is_available()

    def on_grad_ready(self, param: torch.Tensor) -> None:
        if self.first_param is None:
            self.first_param = id(param)
        if id(param) == self.first_param:
            self.backwards += 1
        if not self.on_gpu or self.backwards != self.backwards_per_iteration:
            return
        if not self.in_last_microbatch():
            return
        self.calls += 1
        if self.calls % self.every:
            return
        natural = _allocated_bytes() - self.brought
        if self.previous is not None:
            self.largest_drop = max(self.largest_drop, self.previous - natural)
        self.previous = natural
        self.level = max(self.level, natural)
        if self.margin is None:
            return
        if self.at_step is None:
            return
        room = min(self.level - self.margin - natural, self.level - self.at_step - self.step_extra) - self.brought
        for offloader in self.handle.offloaders:
            if room <= 0:
                break
            started = offloader.prefetch(max_bytes=room)
            room -= started
            self.brought += started

    def on_step_start(self) -> None:
        """Called as the inner optimizer step starts (gradients prepared): learn what the step holds."""
        if self.step_started or not self.on_gpu:
            return
        self.step_started = True
        held = _allocated_bytes() - self.brought
        self.at_step = held if self.at_step is None else max(self.at_step, held)

    def new_iteration(self) -> None:
        """Called after every step: learn from the backward just seen, start afresh."""
        if self.backwards_per_iteration is None and self.backwards:
            self.backwards_per_iteration = self.backwards  # the next iteration samples its last backward
        elif self.calls:
            self.every = max(1, self.calls // PACING_SAMPLES)
            self.margin = max(PACING_MIN_MARGIN_BYTES, 2 * self.largest_drop)
        self.calls, self.level, self.previous, self.brought, self.backwards = 0, 0, None, 0, 0
        self.step_started = False
        self.step_extra = max((offloader.step_footprint() for offloader in self.handle.offloaders), default=0)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


class RoomForForward:
    """Holds the forward back, on the host, while copies out still hold GPU memory it needs.

    After the step the state leaves one chunk at a time and each chunk's memory is freed as its copy
    lands, while the next forward already runs. Where the GPU has room the two simply overlap. Where it
    has not (a full GPU, or a cap), forward pre-hooks wait for the oldest copies out until what is
    allocated, plus a margin for what the forward allocates before the next hook, fits under the
    limit: so the allocator never runs out while our memory is about to be freed. The margin is twice
    the largest growth between two hooks seen so far; the first iteration, with nothing to drain yet
    (attach waits for the masters' copy out), learns it.
    """

    def __init__(self, handle: Handle, model_chunks: Sequence[torch.nn.Module]) -> None:
        self.handle = handle
        modules = {
            id(module): module
            for chunk in model_chunks
            for module in chunk.modules()
            if next(module.parameters(recurse=False), None) is not None
        }
        self.hooks = [module.register_forward_pre_hook(self.before_forward) for module in modules.values()]
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.cuda.current_device() if self.on_gpu else None
        self.learning = True  # until the first step: read at every hook, to learn the growth
        self.previous: int | None = None  # the last reading, without what copies out still hold
        self.largest_growth = 0
        self.limit: int | None = None
        self.waited = 0  # times a forward waited (for tests and the log)

    def before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self.on_gpu:
            return
        pending = self.handle.pending_out_bytes()
        if not pending and not self.learning:
            return
        natural = _allocated_bytes() - pending
        if self.previous is not None:
            self.largest_growth = max(self.largest_growth, natural - self.previous)
        self.previous = natural
        if not pending:
            return
        if self.limit is None:
            self.limit = memory_limit_bytes(self.device)
        margin = max(FORWARD_MIN_MARGIN_BYTES, 2 * self.largest_growth)
        excess = natural + pending + margin - self.limit
        if excess > 0 or self.learning:  # nothing learned yet: let everything land first
            self.waited += 1
            self.handle.drain_out(None if self.learning else excess)

    def new_iteration(self) -> None:
        """Called after every step: the limit is read again, when next needed (other processes may
        have taken memory meanwhile)."""
        self.learning = False
        self.previous = None
        self.limit = None

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def _allocated_bytes() -> int:
    """``torch.cuda.memory_allocated()`` without flattening every allocator statistic into a new dict
    on each call, which the backward hooks would pay many times per iteration."""
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is None:
        return torch.cuda.memory_allocated()
    return stats(torch.cuda.current_device())["allocated_bytes"]["all"]["current"]
