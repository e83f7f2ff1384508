"""Settings of optimizer-state offloading, as one dataclass; flags map onto it in ``args.py``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["OffloadConfig", "PrefetchPolicy"]


class PrefetchPolicy(str, Enum):
    """When the copy of the state back to the GPU starts."""

    FINALIZE = "finalize"
    """When gradients are finalized (backward done): the copy overlaps the gradient reduction."""
    STEP = "step"
    """At the start of ``optimizer.step()``: the copy overlaps grad unscaling, norm and clipping."""


@dataclass(frozen=True)
class OffloadConfig:
    """How the offloader behaves once attached (the on/off switch is attaching at all)."""

    offload_master_weights: bool = True
    """Also offload the fp32 master weights, not only Adam's moments."""
    prefetch: PrefetchPolicy = PrefetchPolicy.FINALIZE
    """When the copy back to the GPU starts; see ``PrefetchPolicy``."""
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
