"""Settings of optimizer-state offloading, as one dataclass; flags map onto it in ``flags.py``.

A value out of range is a ``SettingError`` naming the field (``OffloadConfig.chunk_mb``), as the Python API
gives it; ``flags.config_from_args`` names the flag instead, as the command line gives it.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Literal

from megatron_offload.core.units import GIB

__all__ = ["AUTO", "OffloadConfig", "PrefetchPolicy", "SettingError"]

AUTO = "auto"
"""The ``fraction`` (the default) that keeps on the GPU all the state that fits under the memory limit."""


class PrefetchPolicy(str, Enum):
    """When the copy of the state back to the GPU starts. Whatever has not come back by the step
    streams through the pipelined step, chunk by chunk."""

    AUTO = "auto"
    """What moves comes back during the last micro-batch's backward, into memory that backward has freed
    (so the peak does not rise), then as gradients are finalized as far as the step leaves room; the rest
    streams through the step."""
    FINALIZE = "finalize"
    """All of it when gradients are finalized (backward done): the copy overlaps the gradient reduction."""
    STEP = "step"
    """The smallest footprint: with ``fraction`` "auto" none of the state stays on the GPU, and none comes
    back ahead: the step streams it all, holding at most three chunks on the GPU."""


class SettingError(ValueError):
    """A setting out of range: the field it is, and what is wrong, so each way in can name it its own way."""

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(self.named(f"OffloadConfig.{field}"))

    def named(self, name: str) -> str:
        """The message with the setting called ``name`` (a flag, a keyword)."""
        return f"{name} {self.problem}"


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
    fraction: float | Literal["auto"] = AUTO
    """``"auto"`` (the default): keep on the GPU all the state that fits under the memory limit beside
    what training needs without it (measured in iteration 1), whole chunks, rounded down; move the rest.
    A number: offload at least this share (0 to 1); the rest, whole chunks, stays if it fits."""
    pin_memory: bool = True
    """Pin the host buffers (fast, asynchronous copies); off only for tests on machines without CUDA."""
    check_host_memory: bool = True
    """Refuse to start when the node's host memory cannot hold every rank's offloaded state."""
    gpu_memory_cap_gib: float | None = None
    """Let this process use at most this many GiB of GPU memory, as on a GPU that small, and decide what
    stays on the GPU against it; None: the GPU's own memory is the limit. ``attach_offloader`` applies it
    (the launcher applies it earlier, before the model is built, so that everything counts against it)."""

    def __post_init__(self) -> None:
        cap = self.gpu_memory_cap_gib
        if cap is not None and (not _is_number(cap) or not 0 < cap < math.inf):
            raise SettingError(
                "gpu_memory_cap_gib", f"must be a positive number of GiB (the GPU memory to imitate), got {cap!r}"
            )
        if not isinstance(self.prefetch, PrefetchPolicy):
            choices = ", ".join(policy.value for policy in PrefetchPolicy)
            try:
                object.__setattr__(self, "prefetch", PrefetchPolicy(self.prefetch))
            except ValueError:
                raise SettingError("prefetch", f"must be one of {choices}; got {self.prefetch!r}") from None
        # `not x > 0` rather than `x <= 0`: nan fails every comparison and must be refused too.
        if not _is_number(self.chunk_mb) or not 0 < self.chunk_mb < math.inf:
            raise SettingError(
                "chunk_mb", f"must be a positive number of MiB (the default is 64), got {self.chunk_mb!r}"
            )
        if self.fraction != AUTO and (not _is_number(self.fraction) or not 0.0 <= self.fraction <= 1.0):
            raise SettingError(
                "fraction",
                "must be 'auto' or a number from 0 (offload nothing) to 1 (offload all); 'auto', the default, keeps "
                "what fits; "
                f"got {self.fraction!r}",
            )
        for name in ("offload_master_weights", "pin_memory", "check_host_memory"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(name, f"must be true or false, got {getattr(self, name)!r}")

    @property
    def gpu_memory_cap_bytes(self) -> int | None:
        """The cap in bytes, as the allocator counts; None without one."""
        return None if self.gpu_memory_cap_gib is None else int(self.gpu_memory_cap_gib * GIB)

    def with_changes(self, **changes: object) -> OffloadConfig:
        """A copy with ``changes`` (field names as keywords); an unknown name is a TypeError that lists the
        fields and the nearest one, where ``dataclasses.replace`` would say only that it is unexpected."""
        names = [field.name for field in fields(self)]
        for name in changes:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise TypeError(f"{name!r} is not an offload setting{hint}; the settings: {', '.join(names)}")
        return replace(self, **changes)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
