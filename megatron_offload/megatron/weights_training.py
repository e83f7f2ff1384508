"""Weight streaming in Megatron-LM's training loop (``megatron.training``): the model and the optimizer
are built in device-mapped host memory, and the streamer is attached to the model Megatron built.

``install_weight_hooks(training, get_args, weights, cap_bytes)`` replaces three names in
``megatron.training.training`` (no source changed), each calling the original unless weights are streamed:
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
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_offload.config.weight_flags import WeightConfig
from megatron_offload.core.gpu_memory import gpu_only, uncapped
from megatron_offload.core.mapped_memory import MappedPool, mapped_bytes
from megatron_offload.core.units import GIB
from megatron_offload.megatron.weights_adapter import WeightHandle, attach_weight_streamer, move_buffers_to_gpu
from megatron_offload.megatron.weights_step import StreamedStepHandle, attach_streamed_step
from megatron_offload.weights.stats import WeightStats

__all__ = ["BYTES_PER_PARAM", "StreamedWeights", "install_weight_hooks"]

# Host bytes per parameter with --offload-weights: bf16 weights and fp32 gradients (DDP's buffers), the
# weights' first copy (freed into the pool when DDP builds its buffers, kept for reuse), fp32 masters,
# and Adam's two fp32 moments in the optimizer-state offloader's pinned slab.
BYTES_PER_PARAM = 2 + 4 + 2 + 4 + 8


def _say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


@dataclass
class StreamedWeights:
    """Weight streaming in one training process: the host memory the model is built into, the build while
    it is open, the streamers attached and the figures last logged. ``install_weight_hooks``' wrappers
    share one (the training run's)."""

    pool: MappedPool | None = None
    """Device-mapped host memory, made at the first build and kept (freed blocks are reused)."""
    building: contextlib.ExitStack | None = None
    """Open while setup builds into host memory: the cap lifted, allocations in the pool."""
    handles: list[WeightHandle] = field(default_factory=list)
    """One per model Megatron built and streamed."""
    previous: dict[int, WeightStats] = field(default_factory=dict)
    """Each handle's figures (by ``id``) when the log line last read them."""
    steps: list[StreamedStepHandle] = field(default_factory=list)
    """The streamed optimizer steps attached (one per optimizer over a streamed model)."""
    config: WeightConfig = field(default_factory=WeightConfig)
    """The flags' settings, read once after validation."""

    def begin_building(self, cap_bytes: int | None) -> None:
        """From here on allocations are host memory; the cap (``cap_bytes``, None: none) is lifted."""
        if self.pool is None:
            self.pool = MappedPool()
        self.building = contextlib.ExitStack()
        self.building.enter_context(uncapped(cap_bytes, torch.cuda.current_device()))
        self.building.enter_context(self.pool.allocating())

    def end_building(self) -> None:
        """Allocations are GPU memory again; the cap is set again on top of the host memory built."""
        if self.building is not None:
            building, self.building = self.building, None
            building.close()

    def stream(self, model: list[Any]) -> None:
        moved = move_buffers_to_gpu(model)
        handle = attach_weight_streamer(
            model, weight_slots=self.config.weight_slots, layer_major=self.config.layer_major
        )
        self.handles.append(handle)
        torch.cuda.reset_peak_memory_stats()  # the build's host-memory growth is not a GPU peak
        streamer = handle.streamer
        _say(
            f"megatron-offload: weights streamed: {len(streamer.layers)} layers through "
            f"{len(streamer.weights.slots)} weight and {len(streamer.grads.slots)} gradient slots; GPU memory for "
            f"the slots and the embedding and output layer {streamer.stats.gpu_bytes / GIB:.2f} GiB; "
            f"{mapped_bytes() / GIB:.2f} GiB of weights, gradients and master weights in host memory ({moved} bytes "
            "of module buffers moved to the GPU); backward in "
            f"{self.config.order} order ({self.config.why})"
        )

    def stream_step(self, optimizer: Any, model: list[Any], offload: Any = None) -> None:
        """Once the state offloader is attached to ``optimizer`` (``offload``, its handle): its step over the
        streamed ``model`` becomes one streamed pass (``config.step`` "streamed"; "megatron" keeps
        megatron-core's passes, for comparison), the handle's step footprint counting its buffers."""
        chunks = [id(chunk) for chunk in model]
        handle = next((h for h in self.handles if [id(chunk) for chunk in h.model] == chunks), None)
        if handle is None or self.config.step != "streamed":
            return
        self.steps.append(attach_streamed_step(optimizer, handle, model, offload=offload))
        _say("megatron-offload: the optimizer step streams masters, moments and gradients in one pass")

    def log_fields(self, steps: int = 1) -> str:
        """Megatron log-line fields: bytes each way and exposed copy time per iteration since the last line."""
        fields = ""
        for handle in self.handles:
            current = handle.read_stats()
            before = self.previous.get(id(handle), WeightStats())
            per = max(steps, 1)
            fields += (
                f" weights in/out per iter (GiB): {(current.bytes_in - before.bytes_in) / per / GIB:.2f}/"
                f"{(current.bytes_out - before.bytes_out) / per / GIB:.2f} |"
                f" weights exposed (ms): {(current.exposed_ms - before.exposed_ms) / per:.1f} |"
                f" host-mapped (GiB): {mapped_bytes() / GIB:.2f} |"
            )
            self.previous[id(handle)] = current
        return fields


def install_weight_hooks(
    training: Any,
    get_args: Callable[[], argparse.Namespace],
    weights: StreamedWeights,
    cap_bytes: Callable[[], int | None],
) -> None:
    """Wrap ``training.setup_model_and_optimizer``, ``training.get_megatron_optimizer`` and
    ``training.report_memory`` (see above); ``weights`` holds what they build and attach, ``cap_bytes``
    says the GPU memory cap set on the process (None: none), which the build lifts meanwhile."""
    setup = getattr(training, "setup_model_and_optimizer", None)
    get_megatron_optimizer = training.get_megatron_optimizer

    def setup_in_host_memory(*args: Any, **kwargs: Any) -> Any:
        if not getattr(get_args(), "offload_weights", False):
            return setup(*args, **kwargs)
        weights.begin_building(cap_bytes())
        try:
            return setup(*args, **kwargs)
        finally:
            weights.end_building()  # also where no optimizer was built, or the build failed

    def get_megatron_optimizer_then_stream(config: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if weights.building is None:
            return get_megatron_optimizer(config, model, *args, **kwargs)
        optimizer = get_megatron_optimizer(config, model, *args, **kwargs)  # masters in host memory
        weights.end_building()
        weights.stream(model if isinstance(model, list) else [model])
        return optimizer

    report_memory = getattr(training, "report_memory", None)

    def report_gpu_memory(name: str, *args: Any, **kwargs: Any) -> None:
        if not weights.handles:
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
