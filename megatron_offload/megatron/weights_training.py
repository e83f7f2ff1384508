"""Weight streaming in Megatron-LM's training loop (``megatron.training``): the model and the optimizer
are built in device-mapped host memory, and the streamer is attached to the model Megatron built.

``install_weight_hooks(training, get_args)`` replaces two names in ``megatron.training.training`` (no
source changed), each calling the original:
- ``get_model``: with ``--offload-weights``, the model, its DDP buffers and everything else built there
  go to host memory (``MappedPool``), the GPU memory cap lifted meanwhile and then set again on top of
  them, so a model larger than the GPU never passes through a full-size GPU allocation; module buffers
  (rotary frequencies) then come to the GPU, the streamer is attached, and peak statistics start over;
- ``get_megatron_optimizer``: the fp32 master weights are built in host memory the same way (the
  optimizer-state offloader then leaves them where they are).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_offload.core.gpu_memory import uncapped
from megatron_offload.core.mapped_memory import MappedPool, mapped_bytes
from megatron_offload.core.units import GIB
from megatron_offload.megatron.weights_adapter import WeightHandle, attach_weight_streamer, move_buffers_to_gpu
from megatron_offload.weights.stats import WeightStats

__all__ = ["install_weight_hooks", "weight_bytes_per_param", "weight_handles", "weight_log_fields"]

_pool: MappedPool | None = None
_handles: list[WeightHandle] = []
_previous: dict[int, WeightStats] = {}

# Host bytes per parameter with --offload-weights: bf16 weights and fp32 gradients (DDP's buffers), the
# weights' first copy (freed into the pool when DDP builds its buffers, kept for reuse), fp32 masters,
# and Adam's two fp32 moments in the optimizer-state offloader's pinned slab.
BYTES_PER_PARAM = 2 + 4 + 2 + 4 + 8


def weight_bytes_per_param() -> int:
    return BYTES_PER_PARAM


def weight_handles() -> list[WeightHandle]:
    return list(_handles)


def _say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def _pooled(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``function`` with CUDA allocations going to device-mapped host memory and the cap lifted."""

    def run(*args: Any, **kwargs: Any) -> Any:
        global _pool
        if _pool is None:
            _pool = MappedPool()
        with uncapped(torch.cuda.current_device()), _pool.allocating():
            return function(*args, **kwargs)

    return run


def install_weight_hooks(training: Any, get_args: Callable[[], argparse.Namespace]) -> None:
    """Wrap ``training.get_model`` and ``training.get_megatron_optimizer`` (see the module docstring)."""
    get_model = getattr(training, "get_model", None)
    get_megatron_optimizer = training.get_megatron_optimizer

    def get_model_in_host_memory(*args: Any, **kwargs: Any) -> Any:
        wrap_with_ddp = kwargs.get("wrap_with_ddp", args[2] if len(args) > 2 else True)
        if not getattr(get_args(), "offload_weights", False) or not wrap_with_ddp:
            return get_model(*args, **kwargs)
        model = _pooled(get_model)(*args, **kwargs)
        moved = move_buffers_to_gpu(model)
        handle = attach_weight_streamer(model)
        _handles.append(handle)
        torch.cuda.reset_peak_memory_stats()  # the build's host-memory growth is not a GPU peak
        streamer = handle.streamer
        _say(
            f"megatron-offload: weights streamed: {len(streamer.layers)} layers through "
            f"{len(streamer.weights.slots)} weight and {len(streamer.grads.slots)} gradient slots; GPU memory for "
            f"slots and the embedding/output layer {streamer.stats.gpu_bytes / GIB:.2f} GiB; "
            f"{mapped_bytes() / GIB:.2f} GiB of weights and gradients in host memory ({moved} bytes of buffers moved "
            "to the GPU)"
        )
        return model

    def get_megatron_optimizer_in_host_memory(*args: Any, **kwargs: Any) -> Any:
        if not getattr(get_args(), "offload_weights", False):
            return get_megatron_optimizer(*args, **kwargs)
        return _pooled(get_megatron_optimizer)(*args, **kwargs)

    if get_model is not None:  # every megatron.training that builds models has it
        training.get_model = get_model_in_host_memory
    training.get_megatron_optimizer = get_megatron_optimizer_in_host_memory


def weight_log_fields(steps: int = 1) -> str:
    """Megatron log-line fields: bytes each way and exposed copy time per iteration since the last line."""
    fields = ""
    for handle in _handles:
        current = handle.read_stats()
        before = _previous.get(id(handle), WeightStats())
        per = max(steps, 1)
        fields += (
            f" weights in/out per iter (GiB): {(current.bytes_in - before.bytes_in) / per / GIB:.2f}/"
            f"{(current.bytes_out - before.bytes_out) / per / GIB:.2f} |"
            f" weights exposed (ms): {(current.exposed_ms - before.exposed_ms) / per:.1f} |"
            f" host-mapped (GiB): {mapped_bytes() / GIB:.2f} |"
        )
        _previous[id(handle)] = current
    return fields
