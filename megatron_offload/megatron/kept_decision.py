"""How many bytes of optimizer state stay on the GPU, decided by the scheduler and applied to the offloaders:
what fits under the limit (the default), nothing (``--offload-prefetch step``), or a fixed fraction's share,
refused in one line when it does not fit. Decided once, when iteration 2's step has ended (the peaks of
iterations 1 and 2, the state all in host memory then), in whole chunks rounded down; only lowered after (the
peak grew, memory ran short).

Why iteration 2: iteration 1's step makes Adam's moments, so it streams only the masters, through staging a
third of the size later steps use (with weight streaming also without the stage's buffers). Iteration 2's
step is the first to stream the whole state, the footprint every later step has: decided from iteration 1
alone, the kept state left no room for it (a 4.18B GPT under 16 GiB ran out of memory in iteration 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_offload.config.options import AUTO, OffloadConfig, PrefetchPolicy
from megatron_offload.core.units import GIB
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader
from megatron_offload.optimizer_state.scheduler import Peaks, StateScheduler, whole_chunks

__all__ = ["LEARNING_STEPS", "KeptDecision", "OffloadFitError"]

LEARNING_STEPS = 2  # steps run with the whole state in host memory before the decision (see above)

Offloaders = Sequence[OptimizerStateOffloader]


class OffloadFitError(RuntimeError):
    """A setting keeps more optimizer state on the GPU than the memory limit leaves room for."""


class KeptDecision:
    """The one owner of the scheduler and of the kept-bytes decision; the offloaders keep what it decides.
    ``say`` prints what the default chose (the handle's, which the Megatron hooks point at the first rank)."""

    def __init__(self, config: OffloadConfig, limit: Callable[[], int], say: Callable[[str], None]) -> None:
        self.config = config
        self.scheduler = StateScheduler(limit)
        # The default (fraction "auto"): keep what fits under the limit. `step` with it: keep nothing.
        self.elastic = config.fraction == AUTO and config.prefetch is not PrefetchPolicy.STEP
        self.keeps_none = config.fraction == AUTO and not self.elastic
        self.say = say
        self.steps = 0  # steps that ran (skipped by the loss scale or not)

    @staticmethod
    def kept_bytes(offloaders: Offloaders) -> int:
        """State kept on the GPU across steps."""
        return sum(offloader.kept_bytes for offloader in offloaders)

    def before_step(self) -> None:
        self.scheduler.start_step()  # the limit, read once for this iteration

    def after_step(self, offloaders: Offloaders, stepped: bool, brought: int) -> None:
        """Learn the step's peaks (those of the first ``LEARNING_STEPS``, with all state offloaded, are what
        training needs without it; ``brought``: state the backward brought back early) and decide what stays,
        once, after those steps, lowered if the peak grows."""
        peaks = Peaks(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        grew = self.scheduler.observe_step_end(peaks, resident=self.kept_bytes(offloaders) + brought)
        self.steps += stepped
        if stepped and self.steps >= LEARNING_STEPS and (grew or self.scheduler.kept is None):
            self.decide(offloaders)

    def lowered(self, offloaders: Offloaders) -> None:
        """Kept state was evicted (memory ran short): the decision is lowered to what is still kept."""
        self.scheduler.lower([offloader.kept_bytes for offloader in offloaders])

    def decide(self, offloaders: Offloaders) -> None:
        """What stays on the GPU, in bytes, by the scheduler: what fits (the default), nothing (``step``),
        or a fixed fraction's share, refused in one line when it does not fit."""
        sizes = [offloader.full_sizes() for offloader in offloaders]
        state, first = sum(map(sum, sizes)), self.scheduler.kept is None
        fraction = self.config.fraction
        at_most = None if self.elastic else 0 if self.keeps_none else int((1.0 - fraction) * state)
        if first and at_most:
            wanted, room = sum(whole_chunks(at_most, sizes)), self.scheduler.room()
            if wanted > room:
                for offloader in offloaders:
                    offloader.keep_bytes(0)  # nothing stays: the state is whole in host memory
                raise OffloadFitError(
                    f"megatron-offload: --offload-fraction {fraction:g} keeps {wanted / GIB:.2f} GiB of "
                    f"optimizer state on the GPU, but the memory limit ({self.scheduler.limit() / GIB:.2f} GiB) leaves "
                    f"{room / GIB:.2f} GiB beside what training needs without it "
                    f"({self.scheduler.natural.reserved / GIB:.2f} GiB reserved at its peak): leave "
                    f"--offload-fraction out (keeps what fits), give {min(1.0, 1 - room / state + 0.005):.2f} or more, "
                    "or use --offload-prefetch step. The optimizer state is whole in host memory."
                )
        before = self.scheduler.kept
        kept = self.scheduler.decide(sizes, at_most)
        for offloader, nbytes in zip(offloaders, kept, strict=True):
            offloader.keep_bytes(nbytes)
        if self.elastic and kept != before:
            self.say(self.scheduler.explain(state))

    def smallest_footprint_note(self, offloaders: Offloaders, peak_reserved: int, asked: int) -> str | None:
        """Where no state was on the GPU when memory ran out (the smallest footprint did not fit): what
        training needs without it and the limit, measured; else None (keeping less would have helped)."""
        if self.kept_bytes(offloaders) or any(o.offloaded_bytes < o.plan.host_bytes for o in offloaders):
            return None
        state = sum(offloader.plan.full_bytes() for offloader in offloaders)
        return self.scheduler.too_small(peak_reserved, asked, state)
