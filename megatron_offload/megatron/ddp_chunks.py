"""megatron-core's DDP model chunks as sleep and wake see them (sleep_hooks.py wires these): where
their flat buffers are, whether a collective is using them, and the stand-ins that refuse, with a
sentence, the calls that would touch them while they sleep.

Checked against megatron-core 0.16.1 and 0.19.2. What we rely on, beyond what sleep_hooks.py says of
the buffers themselves:
- DDP ``bucket_groups`` / ``expert_parallel_bucket_groups`` with ``grad_reduce_handle`` and
  ``param_gather_handle``: not None while a collective on the buffers is in flight.
- ``zero_grad_buffer()``, a DDP method, is the first thing a training step does with the buffers, and a
  forward pre-hook on a chunk runs before anything reads its parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_offload.sleep.report import SleepError

__all__ = ["Unset", "ddp_buffers", "in_flight", "refuse_forward", "refuse_zero_grad"]


def ddp_buffers(model_chunks: Sequence[Any]) -> list[Any]:
    """The _ParamAndGradBuffers of DDP chunks (a plain module's ``buffers`` is a method: not ours)."""
    found = []
    for chunk in model_chunks:
        for name in ("buffers", "expert_parallel_buffers"):
            value = vars(chunk).get(name, [])
            found += value if isinstance(value, list) else []
    return found


def in_flight(model_chunks: Sequence[Any]) -> str | None:
    """Why the buffers are in use right now (a collective in flight), or None."""
    for chunk in model_chunks:
        for group in getattr(chunk, "bucket_groups", []) + getattr(chunk, "expert_parallel_bucket_groups", []):
            if getattr(group, "grad_reduce_handle", None) is not None:
                return "while a gradient reduce-scatter is in flight"
            if getattr(group, "param_gather_handle", None) is not None:
                return "while a parameter all-gather is in flight"
    return None


def refuse_forward(module: torch.nn.Module, args: Any) -> None:
    raise SleepError("the model's parameters are asleep: call wake() before running the training model")


def refuse_zero_grad(*args: Any, **kwargs: Any) -> None:
    raise SleepError("the gradient buffers are asleep: call wake() before the next training step")


class Unset:
    """Removes an instance attribute we set, uncovering the class's method again."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        vars(self.obj).pop(self.name, None)
