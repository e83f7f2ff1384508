"""How much optimizer state may be on the GPU, and when, against one memory limit.

The limit is the cap (``--offload-gpu-memory-cap-gib``), else what this process holds plus what the
device has free, in *reserved* bytes: the currency the allocator enforces it in. From readings the
loop hands it (no CUDA here: tested on the CPU) it learns the natural peak, training's need without
state (iteration 1 runs with all of it offloaded), and its growth (a later peak passing every earlier
one). It decides ``kept_budget`` (``--offload-fraction auto``: the limit less the natural peak and a
margin), ``backlog_budget`` (copies out that may still be pending when a step returns: the same room
less what is kept) and ``backward_room`` (what may come back in the last backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_offload.core.units import GIB, MIB

__all__ = ["Peaks", "StateScheduler"]

MARGIN_SHARE = 0.03  # of the limit, kept free for what no reading sees (allocator rounding, spikes)
MIN_MARGIN_BYTES = 128 * MIB


@dataclass(frozen=True)
class Peaks:
    """The process's peak allocated and reserved bytes (``torch.cuda.max_memory_*``)."""

    allocated: int
    reserved: int


class StateScheduler:
    """The memory ledger of one process's optimizer state; see the module docstring."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit  # read once per step (other processes may take memory meanwhile): see limit()
        self._limit_now: int | None = None
        self.natural: Peaks | None = None  # None until the first step has been seen
        self._last_peaks: Peaks | None = None  # the process's peaks when the latest step ended
        self.grown = 0  # bytes the natural peak grew by after iteration 1

    # ------------------------------------------------------------------------------ learning
    def observe_step_start(self, peaks: Peaks, on_gpu_at_peak: int) -> bool:
        """At each step's start, before the step allocates anything. ``on_gpu_at_peak``: optimizer
        state that may have been on the GPU when the forward and backward peaked (kept state: counted
        as resident, which can only make the estimate larger). Returns True when the natural peak grew."""
        self._limit_now = self._limit()
        if self.natural is None:
            self.natural = peaks  # iteration 1: no state on the GPU, nothing brought back yet
            return False
        last = self._last_peaks or self.natural
        if peaks.allocated <= last.allocated and peaks.reserved <= last.reserved:
            return False
        # A new process-wide peak during forward and backward: natural need plus what was resident.
        allocated = max(self.natural.allocated, peaks.allocated - on_gpu_at_peak)
        reserved = max(self.natural.reserved, peaks.reserved - on_gpu_at_peak)
        if allocated == self.natural.allocated and reserved == self.natural.reserved:
            return False
        self.grown += reserved - self.natural.reserved
        self.natural = Peaks(allocated, reserved)
        return True

    def observe_step_end(self, peaks: Peaks) -> None:
        """After each step: what the step itself raised the peaks to is not the forward's doing."""
        self._last_peaks = peaks

    # ----------------------------------------------------------------------------- decisions
    @property
    def learned(self) -> bool:
        return self.natural is not None

    def limit(self) -> int:
        """The limit as read at the latest step's start. Not per reading: uncapped it is a driver call
        (free memory) plus the allocator's statistics, which the hooks would pay dozens of times per pass."""
        return self._limit() if self._limit_now is None else self._limit_now

    def margin(self, limit: int | None = None) -> int:
        return max(MIN_MARGIN_BYTES, int(MARGIN_SHARE * (self.limit() if limit is None else limit)))

    def room(self) -> int:
        """Bytes the forward's natural peak leaves under the limit, less the margin (None learned: 0)."""
        if self.natural is None:
            return 0
        limit = self.limit()
        return max(0, limit - self.margin(limit) - self.natural.reserved)

    def kept_budget(self, state_bytes: int) -> int:
        """State that may stay on the GPU through forward and backward (``fraction`` auto)."""
        return min(state_bytes, self.room())

    def backlog_budget(self, kept_bytes: int) -> int:
        """Offload copies that may still be pending when the step returns: they overlap the next
        forward only as far as its natural peak leaves room beside what is kept."""
        return max(0, self.room() - kept_bytes)

    @property
    def caching_gap(self) -> int:
        """Reserved minus allocated at the natural peak: what the allocator holds beyond live tensors."""
        return 0 if self.natural is None else max(0, self.natural.reserved - self.natural.allocated)

    def backward_room(self, allocated: int) -> int:
        """Bytes that may come back now during backward without the reserved total passing the limit
        less the margin (the pacer's own rule keeps the peak where the forward left it)."""
        limit = self.limit()
        return limit - self.margin(limit) - self.caching_gap - allocated

    def explain(self, kept: int, state_bytes: int) -> str:
        """One line for the log: what ``auto`` chose and why."""
        limit = self.limit()
        natural = self.natural.reserved if self.natural else 0
        grown = f" (grew by {self.grown / GIB:.2f} GiB since iteration 1)" if self.grown else ""
        return (
            f"megatron-offload: --offload-fraction auto keeps {kept / GIB:.2f} of {state_bytes / GIB:.2f} GiB of "
            f"optimizer state on the GPU and offloads {(state_bytes - kept) / GIB:.2f} GiB: memory limit "
            f"{limit / GIB:.2f} GiB, peak without state {natural / GIB:.2f} GiB reserved{grown}, "
            f"margin {self.margin(limit) / GIB:.2f} GiB"
        )
