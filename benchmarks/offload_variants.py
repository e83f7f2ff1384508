"""The ways offload_bandwidth.py trains its GPT (VARIANTS): no offload, our offload under each prefetch
policy, a naive synchronous offload and megatron-core's HybridDeviceOptimizer; and one run of a variant, under
a GPU memory cap if given: its step times after the warm-up, its peaks and its copies' times and rates.
offload_bandwidth.py imports it once the allocator's setting is made, before CUDA starts.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from copy import copy
from typing import Any

import torch

from benchmarks.gpt_training import GPTShape, GPTTraining, build_gpt_training, state_bytes
from megatron_offload import attach_offloader

GB, GIB = 1e9, 2**30
WARMUP = 2  # iterations left out of every figure (the first builds the plan and pins the slab)
HYBRID = {  # megatron-core's --optimizer-cpu-offload, whole state on the CPU
    "optimizer_cpu_offload": True,
    "use_precision_aware_optimizer": True,
    "optimizer_offload_fraction": 1.0,
    "overlap_cpu_optimizer_d2h_h2d": True,
}


def naive_offload(training: GPTTraining) -> Any:
    """Everything back before the step and out after it, the host waiting each time."""
    handle = attach_offloader(training.optimizer, prefetch="step")
    offloading_step = training.optimizer.step

    def blocking_step(*args: Any, **kwargs: Any) -> Any:
        handle.wait()
        torch.cuda.synchronize()
        result = offloading_step(*args, **kwargs)
        torch.cuda.synchronize()
        return result

    training.optimizer.step = blocking_step
    return handle


VARIANTS: dict[str, tuple[dict[str, Any], Callable[[GPTTraining], Any] | None]] = {
    "no offload": ({}, None),
    "auto": ({}, lambda t: attach_offloader(t.optimizer, prefetch="auto")),
    "auto, chunks of 256 MiB": ({}, lambda t: attach_offloader(t.optimizer, prefetch="auto", chunk_mb=256)),
    "finalize": ({}, lambda t: attach_offloader(t.optimizer, prefetch="finalize")),
    "step (streamed)": ({}, lambda t: attach_offloader(t.optimizer, prefetch="step")),
    "naive synchronous": ({}, naive_offload),
    "HybridDeviceOptimizer": (HYBRID, None),
}


def run(
    shape: GPTShape, steps: int, overrides: dict[str, Any], attach: Callable | None, cap: int | None = None
) -> dict[str, Any]:
    """Train ``steps`` iterations, under ``cap`` bytes of GPU memory if given. Allocated figures count
    only what this run allocated; reserved figures are the process's (what the GPU had to hold)."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((cap or total) / total)
    try:
        return _train(shape, steps, overrides, attach)
    except torch.OutOfMemoryError as error:
        return {"error": f"out of memory: {str(error).splitlines()[0][:160]}"}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _train(shape: GPTShape, steps: int, overrides: dict[str, Any], attach: Callable | None) -> dict[str, Any]:
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    training = build_gpt_training(shape, optimizer_overrides=overrides)
    state = state_bytes(training)
    handle = attach(training) if attach else None
    at_warmup = None
    step_seconds = []
    for iteration in range(steps):
        if iteration == WARMUP:
            at_warmup = copy(handle.read_stats()) if handle is not None else None
        # The loss is read (``.item()``) right after the step, as Megatron-LM's train_step reads a GPU
        # value there: whatever that read waits for counts as step time.
        start = time.perf_counter()
        training.train_step(iteration, read_loss=True)
        step_seconds.append(time.perf_counter() - start)
    peak_allocated = torch.cuda.max_memory_allocated()  # over the whole run, iteration 1 included
    result: dict[str, Any] = {
        "median_step_s": statistics.median(step_seconds[WARMUP:]),
        "step_s": step_seconds,
        "peak_allocated_GiB": (peak_allocated - before) / GIB,
        "peak_allocated_abs_GiB": peak_allocated / GIB,
        "peak_reserved_GiB": torch.cuda.max_memory_reserved() / GIB,
        "allocated_between_steps_GiB": (torch.cuda.memory_allocated() - before) / GIB,
        "state_GiB": state / GIB,
    }
    if handle is not None:
        stats, measured = handle.read_stats(), steps - WARMUP
        out, back, exposed = (
            (getattr(stats, name) - getattr(at_warmup, name)) / measured
            for name in ("offload_seconds", "prefetch_seconds", "exposed_seconds")
        )
        offloaded = stats.host_bytes  # each step moves all of it out and all of it back
        result |= {"offloaded_GB": offloaded / GB, "copy_out_s": out, "copy_back_s": back, "exposed_s": exposed}
        result |= {"copy_out_GBps": offloaded / out / GB, "copy_back_GBps": offloaded / back / GB}
        result["streamed_share"] = stats.bytes_streamed / max(stats.bytes_prefetched, 1)
        handle.detach()
    return result


def run_variant(shape: GPTShape, steps: int, name: str, cap: int | None = None) -> dict[str, Any]:
    overrides, attach = VARIANTS[name]
    try:
        row = run(shape, steps, overrides, attach, cap)
    except Exception as error:  # a reference that cannot run here is reported, not fatal
        row = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    print(name if cap is None else f"{name}, capped", json.dumps(row, default=str), flush=True)
    return row
