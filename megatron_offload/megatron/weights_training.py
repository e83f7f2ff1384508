"""Weight streaming in Megatron-LM's training loop (``megatron.training``): the model and the optimizer
are built in device-mapped host memory, and the streamer is attached to the model Megatron built.

``install_weight_hooks(training, get_args)`` replaces three names in ``megatron.training.training`` (no
source changed), each calling the original unless weights are streamed:
- ``setup_model_and_optimizer``: with ``--offload-weights``, everything it builds goes to host memory
  (``MappedPool``) until the optimizer exists: the model, DDP's weight and gradient buffers and the fp32
  master weights, whichever way Megatron builds the model (``get_model`` or a config container's
  builder). The GPU memory cap is lifted meanwhile and set again on top of what was built, so a model
  larger than the GPU never passes through a full-size GPU allocation;
- ``get_megatron_optimizer``: once the original has built the optimizer, the host-memory build ends,
  module buffers (rotary frequencies) come to the GPU, the streamer is attached and peak statistics
  start over; then (in ``training_hooks``) the optimizer-state offloader is attached in GPU memory;
- ``report_memory``: Megatron's memory line reads PyTorch's counters, which count the host-mapped
  weights as GPU memory; with weights streamed the same line reports GPU memory only and names the
  host-mapped bytes apart.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_offload.config.flags import config_from_args
from megatron_offload.core.gpu_memory import gpu_only, uncapped
from megatron_offload.core.mapped_memory import MappedPool, mapped_bytes
from megatron_offload.core.units import GIB
from megatron_offload.megatron.weights_adapter import WeightHandle, attach_weight_streamer, move_buffers_to_gpu
from megatron_offload.weights.stats import WeightStats

__all__ = ["BYTES_PER_PARAM", "install_weight_hooks", "weight_log_fields"]

_pool: MappedPool | None = None
_building: contextlib.ExitStack | None = None  # open while setup builds into host memory
_handles: list[WeightHandle] = []
_previous: dict[int, WeightStats] = {}

# Host bytes per parameter with --offload-weights: bf16 weights and fp32 gradients (DDP's buffers), the
# weights' first copy (freed into the pool when DDP builds its buffers, kept for reuse), fp32 masters,
# and Adam's two fp32 moments in the optimizer-state offloader's pinned slab.
BYTES_PER_PARAM = 2 + 4 + 2 + 4 + 8


def _say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def _begin_building(cap_bytes: int | None) -> None:
    global _pool, _building
    if _pool is None:
        _pool = MappedPool()
    _building = contextlib.ExitStack()
    _building.enter_context(uncapped(cap_bytes, torch.cuda.current_device()))
    _building.enter_context(_pool.allocating())


def _end_building() -> None:
    """Allocations are GPU memory again; the cap is set again on top of the host memory built."""
    global _building
    if _building is not None:
        building, _building = _building, None
        building.close()


def _stream(model: list[Any]) -> None:
    moved = move_buffers_to_gpu(model)
    handle = attach_weight_streamer(model)
    _handles.append(handle)
    torch.cuda.reset_peak_memory_stats()  # the build's host-memory growth is not a GPU peak
    streamer = handle.streamer
    _say(
        f"megatron-offload: weights streamed: {len(streamer.layers)} layers through {len(streamer.weights.slots)} "
        f"weight and {len(streamer.grads.slots)} gradient slots; GPU memory for the slots and the embedding and "
        f"output layer {streamer.stats.gpu_bytes / GIB:.2f} GiB; {mapped_bytes() / GIB:.2f} GiB of weights, "
        f"gradients and master weights in host memory ({moved} bytes of module buffers moved to the GPU)"
    )


def install_weight_hooks(training: Any, get_args: Callable[[], argparse.Namespace]) -> None:
    """Wrap ``training.setup_model_and_optimizer`` and ``training.get_megatron_optimizer`` (see above)."""
    setup = getattr(training, "setup_model_and_optimizer", None)
    get_megatron_optimizer = training.get_megatron_optimizer

    def setup_in_host_memory(*args: Any, **kwargs: Any) -> Any:
        megatron_args = get_args()
        if not getattr(megatron_args, "offload_weights", False):
            return setup(*args, **kwargs)
        _begin_building(config_from_args(megatron_args).gpu_memory_cap_bytes)
        try:
            return setup(*args, **kwargs)
        finally:
            _end_building()  # also where no optimizer was built, or the build failed

    def get_megatron_optimizer_then_stream(config: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if _building is None:
            return get_megatron_optimizer(config, model, *args, **kwargs)
        optimizer = get_megatron_optimizer(config, model, *args, **kwargs)  # masters in host memory
        _end_building()
        _stream(model if isinstance(model, list) else [model])
        return optimizer

    report_memory = getattr(training, "report_memory", None)

    def report_gpu_memory(name: str, *args: Any, **kwargs: Any) -> None:
        if not _handles:
            return report_memory(name, *args, **kwargs)
        mib = 1024.0 * 1024.0
        figures = (
            ("allocated", gpu_only(torch.cuda.memory_allocated(), allocated=True)),
            ("max allocated", gpu_only(torch.cuda.max_memory_allocated(), allocated=True)),
            ("reserved", gpu_only(torch.cuda.memory_reserved())),
            ("max reserved", gpu_only(torch.cuda.max_memory_reserved())),
        )
        line = "".join(f" | {key}: {value / mib:.2f}" for key, value in figures)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0:
            print(f"[Rank {rank}] {name} memory (MB){line} | host-mapped, not counted: {mapped_bytes() / mib:.2f}")

    if report_memory is not None:
        training.report_memory = report_gpu_memory
    if setup is not None:  # every megatron.training that builds models has it
        training.setup_model_and_optimizer = setup_in_host_memory
    training.get_megatron_optimizer = get_megatron_optimizer_then_stream


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
