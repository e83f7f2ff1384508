"""How much optimizer state stays on the GPU, and when the rest may move, against one memory limit.

The limit is the cap (``--offload-gpu-memory-cap-gib``), else what this process holds plus what the
device has free, in *reserved* bytes: the currency the allocator enforces it in. From readings the
loop hands it (no CUDA here: tested on the CPU) it learns the natural peak: what training needs
without state, from the first steps' peaks, the whole state in host memory (forward, backward and a
step that streamed the whole state: the footprint of ``--offload-prefetch step``; the caller decides
after the first step that streamed all of it), and its growth (a later peak, less the state that was
resident, passing it).

From these it decides, in bytes, ``kept``: the state that stays on the GPU, whole chunks from the
back of each offloader, never more than the limit leaves beside the natural peak and a margin
(rounded down), decided once and only lowered after (the peak grew, or a forward had to evict). With
room to spare that is all of it and nothing moves; where the whole state fits nowhere, none.
It also bounds the copies a step may leave pending (``backlog_budget``) and what may come back in
the last backward (``backward_room``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_offload.core.gpu_memory import gpu_only
from megatron_offload.core.units import GIB, MIB

__all__ = ["Peaks", "StateScheduler", "kept_chunks", "kept_within", "whole_chunks"]

MARGIN_SHARE = 0.03  # of the limit, kept free for what no reading sees (allocator rounding, spikes)
MIN_MARGIN_BYTES = 128 * MIB


@dataclass(frozen=True)
class Peaks:
    """The process's peak allocated and reserved bytes (``torch.cuda.max_memory_*``)."""

    allocated: int
    reserved: int


def kept_within(sizes: Sequence[int], budget: int) -> int:
    """Bytes of the whole chunks ``kept_chunks`` keeps of ``sizes`` within ``budget``."""
    return sum(sizes[index] for index in kept_chunks(sizes, budget))


def kept_chunks(sizes: Sequence[int], budget: int) -> set[int]:
    """Which whole chunks stay within ``budget``: from the back of the step order, each that fits in what
    is left, passing over one that does not (the output layer's 1 GiB state, last in the step order, would
    otherwise keep the smaller chunks before it off the GPU too). Kept within their own total, the same chunks
    again (an eviction, which lets the frontmost kept chunks go, leaves such a set too)."""
    kept, left = set(), budget
    for index in range(len(sizes) - 1, -1, -1):
        if sizes[index] <= left:
            kept.add(index)
            left -= sizes[index]
    return kept


def whole_chunks(budget: int, sizes: Sequence[Sequence[int]], ceilings: Sequence[int] | None = None) -> list[int]:
    """Split ``budget`` over offloaders (``sizes``: each one's chunk sizes in step order) into whole
    chunks from the back of each (``kept_chunks``): a share in proportion to its state, rounded down, then
    what rounding left over to whichever can take a whole chunk more. Never more than ``budget`` in total, nor than
    an offloader's ceiling (what it kept before: decisions only go down)."""
    totals = [sum(s) for s in sizes]
    state = sum(totals)
    budget = max(0, min(budget, state))
    ceilings = list(ceilings) if ceilings is not None else totals
    shares = [
        kept_within(s, min(ceiling, budget * total // state if state else 0))
        for s, total, ceiling in zip(sizes, totals, ceilings, strict=True)
    ]
    for index, (s, ceiling) in enumerate(zip(sizes, ceilings, strict=True)):
        left = budget - sum(shares)
        shares[index] = kept_within(s, min(ceiling, shares[index] + left))
    return shares


class StateScheduler:
    """The memory ledger of one process's optimizer state; see the module docstring."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit  # read once per step (other processes may take memory meanwhile): see limit()
        self._limit_now: int | None = None
        self.natural: Peaks | None = None  # None until iteration 1's step has ended
        self._last_peaks: Peaks | None = None  # the process's peaks when the latest step ended
        self.grown = 0  # bytes the natural peak grew by after iteration 1
        self.kept: list[int] | None = None  # bytes each offloader keeps on the GPU; None: not decided yet

    # ------------------------------------------------------------------------------ learning
    def start_step(self) -> None:
        """At each step's start: read the limit for this iteration."""
        self._limit_now = self._limit()

    def observe_step_end(self, peaks: Peaks, resident: int) -> bool:
        """After each step. Iteration 1 ran with all state offloaded: its peaks are the natural peak.
        Later, ``resident``: state that may have been on the GPU at the peak (kept, brought back early),
        subtracted in full, which can only make the estimate smaller. True when the natural peak grew."""
        last, self._last_peaks = self._last_peaks, peaks
        if self.natural is None:
            self.natural = peaks
            return False
        if last is not None and peaks.allocated <= last.allocated and peaks.reserved <= last.reserved:
            return False  # no new process-wide peak: nothing new to learn
        allocated = max(self.natural.allocated, peaks.allocated - resident)
        reserved = max(self.natural.reserved, peaks.reserved - resident)
        if reserved == self.natural.reserved and allocated == self.natural.allocated:
            return False
        self.grown += reserved - self.natural.reserved
        self.natural = Peaks(allocated, reserved)
        return True

    # ----------------------------------------------------------------------------- decisions
    @property
    def decided(self) -> bool:
        """What stays is decided: until then the steps' peaks are read with all state in host memory, so
        nothing may come back ahead of a step."""
        return self.kept is not None

    def limit(self) -> int:
        """The limit as read at the latest step's start. Not per reading: uncapped it is a driver call
        (free memory) plus the allocator's statistics, which the hooks would pay dozens of times per pass."""
        return self._limit() if self._limit_now is None else self._limit_now

    def margin(self, limit: int | None = None) -> int:
        return max(MIN_MARGIN_BYTES, int(MARGIN_SHARE * (self.limit() if limit is None else limit)))

    def room(self) -> int:
        """Bytes the natural peak leaves under the limit, less the margin (nothing learned: 0)."""
        if self.natural is None:
            return 0
        limit = self.limit()
        return max(0, limit - self.margin(limit) - self.natural.reserved)

    def decide(self, sizes: Sequence[Sequence[int]], at_most: int | None = None) -> list[int]:
        """Bytes each offloader keeps (``sizes``: its chunks' full sizes in step order): whole chunks
        within the room, and within ``at_most`` (a fixed fraction's share). Once decided, only lowered."""
        budget = self.room() if at_most is None else min(self.room(), at_most)
        self.kept = whole_chunks(budget, sizes, self.kept)
        return self.kept

    def lower(self, kept: Sequence[int]) -> None:
        """What each offloader keeps after an eviction: the decision from now on, never raised again."""
        before = self.kept or list(kept)
        self.kept = [min(now, was) for now, was in zip(kept, before, strict=True)]

    @property
    def kept_total(self) -> int:
        return sum(self.kept or ())

    def backlog_budget(self, kept_bytes: int) -> int:
        """Offload copies that may still be pending when the step returns: they overlap the next
        forward only as far as its natural peak leaves room beside what is kept."""
        return max(0, self.room() - kept_bytes)

    @property
    def caching_gap(self) -> int:
        """Reserved minus allocated at the natural peak: what the allocator holds beyond live tensors."""
        return 0 if self.natural is None else max(0, self.natural.reserved - self.natural.allocated)

    def headroom(self) -> int:
        """Allocated bytes that keep the reserved total under the limit less the margin: the limit less the
        margin and the caching gap (the forward's and the backward's hooks both go by it)."""
        limit = self.limit()
        return limit - self.margin(limit) - self.caching_gap

    def backward_room(self, allocated: int) -> int:
        """Bytes that may come back now during backward without the reserved total passing the limit
        less the margin (the pacer's own rule keeps the peak where the forward left it)."""
        return self.headroom() - allocated

    def spare(self, reserved: int) -> int:
        """Bytes the allocator may still map beside ``reserved`` (what it has mapped now) with the margin left
        free: what may come back during backward without a retry, however scattered the free memory it holds."""
        limit = self.limit()
        return limit - self.margin(limit) - reserved

    # ------------------------------------------------------------------------------- telling
    def explain(self, state_bytes: int) -> str:
        """One line for the log: what stays on the GPU and why, in GPU memory alone (the device-mapped host
        memory the allocator counts in the limit and the peak is left out of both)."""
        limit, kept = self.limit(), self.kept_total
        natural = gpu_only(self.natural.reserved) if self.natural else 0
        grown = f" (grew by {self.grown / GIB:.2f} GiB since iteration 1)" if self.grown else ""
        return (
            f"megatron-offload: keeps {kept / GIB:.2f} of {state_bytes / GIB:.2f} GiB of optimizer state on the "
            f"GPU and moves {(state_bytes - kept) / GIB:.2f} GiB: memory limit {gpu_only(limit) / GIB:.2f} GiB, peak "
            f"without state {natural / GIB:.2f} GiB reserved{grown}, margin {self.margin(limit) / GIB:.2f} GiB"
        )

    def too_small(self, peak_reserved: int, asked: int, state_bytes: int) -> str:
        """The numbers of a run out of memory with the whole state in host memory (the smallest footprint
        did not fit): what training needs without the state, at least, and the limit. In GPU memory alone, as
        ``peak_reserved`` is: the device-mapped host memory the allocator counts too is left out."""
        natural = gpu_only(self.natural.reserved) if self.natural else 0
        needs = max(peak_reserved + asked, natural)
        return (
            f"even with all {state_bytes / GIB:.2f} GiB of optimizer state in host memory, training needs at least "
            f"{needs / GIB:.2f} GiB without it ({peak_reserved / GIB:.2f} GiB reserved at the peak + "
            f"{asked / GIB:.2f} GiB asked) and the memory limit is {gpu_only(self.limit()) / GIB:.2f} GiB"
        )
