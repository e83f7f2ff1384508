"""Settings of optimizer-state offloading, as one dataclass; flags map onto it in ``args.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Literal

__all__ = ["AUTO", "OffloadConfig", "PrefetchPolicy"]

AUTO = "auto"
"""The ``fraction`` that lets the offloader choose how much to keep on the GPU."""


class PrefetchPolicy(str, Enum):
    """When the copy of the state back to the GPU starts. Whatever has not come back by the step
    streams through the pipelined step, chunk by chunk."""

    AUTO = "auto"
    """During the last micro-batch's backward, into memory that backward has freed (so the peak does
    not rise); the rest streams through the step."""
    FINALIZE = "finalize"
    """All of it when gradients are finalized (backward done): the copy overlaps the gradient reduction."""
    STEP = "step"
    """None of it ahead: the step streams everything, holding at most three chunks on the GPU."""


@dataclass(frozen=True)
class OffloadConfig:
    """How the offloader behaves once attached (the on/off switch is attaching at all)."""

    offload_master_weights: bool = True
    """Also offload the fp32 master weights, not only Adam's moments."""
    prefetch: PrefetchPolicy = PrefetchPolicy.AUTO
    """When the copy back to the GPU starts; see ``PrefetchPolicy``."""
    chunk_mb: float = 64.0
    """Size of the pieces the state moves in, in MiB: whole parameters, so a parameter larger than
    this makes a chunk of its own. The pipelined step holds three chunks on the GPU."""
    fraction: float | Literal["auto"] = 1.0
    """Share of the state to offload (0 to 1, in whole chunks); the rest stays on the GPU. ``"auto"``:
    keep on the GPU as much as the memory limit allows (measured over the first iterations), offload
    the rest."""
    pin_memory: bool = True
    """Pin the host buffers (fast, asynchronous copies); off only for tests on machines without CUDA."""
    check_host_memory: bool = True
    """Refuse to start when the node's host memory cannot hold every rank's offloaded state."""

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, PrefetchPolicy):
            choices = ", ".join(policy.value for policy in PrefetchPolicy)
            try:
                object.__setattr__(self, "prefetch", PrefetchPolicy(self.prefetch))
            except ValueError:
                raise ValueError(
                    f"--offload-prefetch={self.prefetch!r} is not a prefetch policy; choose one of: {choices}"
                ) from None
        # `not x > 0` rather than `x <= 0`: nan fails every comparison and must be refused too.
        if not _is_number(self.chunk_mb) or not 0 < self.chunk_mb < math.inf:
            raise ValueError(
                f"--offload-chunk-mb must be a positive number of MiB (the default is 64), got {self.chunk_mb!r}"
            )
        if self.fraction != AUTO and (not _is_number(self.fraction) or not 0.0 <= self.fraction <= 1.0):
            raise ValueError(
                "--offload-fraction must be 'auto' or a number from 0 (offload nothing) to 1 (offload all, "
                f"the default), got {self.fraction!r}"
            )
        for name in ("offload_master_weights", "pin_memory", "check_host_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"OffloadConfig.{name} must be true or false, got {getattr(self, name)!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
