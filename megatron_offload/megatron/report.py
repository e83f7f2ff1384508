"""The offload figures appended to Megatron's per-iteration log line (no CUDA or Megatron needed)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_offload.core.stats import OffloadStats
from megatron_offload.core.units import GIB


@dataclass(frozen=True)
class MemoryReading:
    """GPU memory of this rank, in bytes, as torch.cuda reports it."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    """What the GPU really had to hold at the peak: allocated memory plus the allocator's cached blocks."""


def format_offload_fields(current: OffloadStats, previous: OffloadStats, memory: MemoryReading) -> str:
    """Fields in Megatron's ``name: value |`` style, averaged per step over the steps since ``previous``."""
    steps = max(current.offloads - previous.offloads, 1)

    def per_step(name: str) -> float:
        return (getattr(current, name) - getattr(previous, name)) / steps

    def per_step_ms(name: str) -> float:
        return per_step(name) * 1000

    return (
        f" offloaded per rank (GiB): {current.offloaded_bytes / GIB:.2f} |"
        f" kept on GPU (GiB): {current.kept_bytes / GIB:.2f} |"
        f" offload copy out/in (ms): {per_step_ms('offload_seconds'):.1f}/{per_step_ms('prefetch_seconds'):.1f} |"
        f" offload streamed in step (GiB): {per_step('bytes_streamed') / GIB:.2f} |"
        f" offload exposed (ms): {per_step_ms('exposed_seconds'):.1f} |"
        f" allocator retries: {current.allocator_retries - previous.allocator_retries} |"
        f" mem allocated/reserved (GiB): {memory.allocated / GIB:.2f}/{memory.reserved / GIB:.2f} |"
        f" mem peak allocated/reserved (GiB): {memory.peak_allocated / GIB:.2f}/{memory.peak_reserved / GIB:.2f} |"
    )
