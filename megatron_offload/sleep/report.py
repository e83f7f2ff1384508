"""What a sleep, wake or prepare tells its caller: ``SleepReport`` (each part's bytes and time on the link,
and the device's memory around the call, read by ``device_memory()``) and ``SleepError``, the refusal
raised before anything moves.

sleeper.py and parts.py make them; code that reads reports or catches refusals (megatron/sleep_hooks.py,
the sleep/wake benchmark, the package's face) imports them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_offload.sleep.parked_buffers import Transfer

__all__ = ["SleepError", "SleepReport", "device_memory"]


class SleepError(RuntimeError):
    """A sleep or wake that cannot be done; nothing has moved."""


@dataclass
class SleepReport:
    """What a ``prepare()``, ``sleep()`` or ``wake()`` moved (or pinned), how long it took, and the
    device's memory around it (zeros without CUDA)."""

    direction: str  # "prepare", "sleep" or "wake"
    transfers: list[Transfer] = field(default_factory=list)  # per part; in a prepare report, bytes pinned
    seconds: float = 0.0  # wall clock of the whole call, pinning and allocation included
    pinned: list[Transfer] = field(default_factory=list)  # host memory a sleep had to pin first (not prepared)
    device_free_before: int = 0  # torch.cuda.mem_get_info()[0], after emptying PyTorch's cache
    device_free_after: int = 0
    allocated_before: int = 0  # torch.cuda.memory_allocated(): what live tensors of this process hold
    allocated_after: int = 0
    reserved_after: int = 0  # torch.cuda.memory_reserved(): what PyTorch's allocator still holds

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    @property
    def gb_per_s(self) -> float:
        """The whole call's rate, wall clock."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def given_back(self) -> int:
        """Device memory other processes gained (a sleep) or lost (a wake, negative)."""
        return self.device_free_after - self.device_free_before

    @property
    def held_by_allocator(self) -> int:
        """Memory PyTorch's caching allocator still holds after the call though no tensor uses it: pages of
        its segments shared with live tensors, which it cannot give back to the device."""
        return self.reserved_after - self.allocated_after

    def describe(self) -> str:
        """One log line: what moved, how fast, and (a sleep) what the device got back."""
        parts = ", ".join(f"{t.part} {t.nbytes / 1e9:.2f} GB at {t.gb_per_s:.1f} GB/s" for t in self.transfers)
        if self.direction == "prepare":
            return f"pinned host memory for sleep: {parts} ({self.seconds:.2f} s)"
        line = f"{self.nbytes / 1e9:.2f} GB in {self.seconds:.3f} s ({self.gb_per_s:.1f} GB/s wall; {parts})"
        if self.direction == "sleep" and torch.cuda.is_available():
            share = self.given_back / self.nbytes if self.nbytes else 1.0
            line += f"; the device got {self.given_back / 1e9:.2f} GB back ({share:.0%} of what moved)"
            if self.held_by_allocator > 0:
                line += (
                    f", {self.held_by_allocator / 1e9:.2f} GB stays with PyTorch's allocator (free, but in pages "
                    "shared with live tensors)"
                )
        return line


def device_memory() -> tuple[int, int, int]:
    """(device free, allocated, reserved) bytes of the current device; zeros without CUDA."""
    if not torch.cuda.is_available():
        return 0, 0, 0
    return torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
