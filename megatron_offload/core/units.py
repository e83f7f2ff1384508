"""Byte units, and the memory cap that asks offloading for a given share of the state, stated once."""

from __future__ import annotations

__all__ = ["GIB", "MIB", "SAVING_SHARE", "cap_below_peak"]

MIB = 1024**2
GIB = 1024**3
SAVING_SHARE = 0.9  # what offloading promises to take off the peak: 90% of the state


def cap_below_peak(no_offload_peak: float, state: float, share: float = SAVING_SHARE) -> float:
    """A memory cap (same unit as the arguments) that training without offloading cannot fit: its peak
    less ``share`` of the optimizer state, which offloading must save to fit."""
    return no_offload_peak - share * state
