"""Side-by-side benchmark on one GPU, in one process: a megatron-core GPT trained with no offload, with
our offload under each prefetch policy, with a naive synchronous offload (everything copied back before
the step and out after it, nothing overlapped: the floor a smarter scheme must beat) and with
megatron-core's HybridDeviceOptimizer (Adam on the CPU); plus plain pinned copies of the same size, so
the offloader's copies can be read as a fraction of what the link gives. The loss is read after every
step, as Megatron-LM's train_step reads a GPU value there. Time is taken after two warm-up iterations.

``--cap``: then again under a GPU memory cap of the no-offload peak less 90% of the state (as on a GPU
too small for the model): no offload must fail, every policy must run under it.

    python -m benchmarks.offload_bandwidth --json results.json [--cap]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from copy import copy
from importlib.metadata import version
from typing import Any

from megatron_offload.core.gpu_memory import use_expandable_segments_by_default

ALLOCATOR_NOTE = use_expandable_segments_by_default()  # before CUDA starts, as our entry points do

import torch  # noqa: E402

from benchmarks.gpt_training import GPTShape, GPTTraining, build_gpt_training, init_distributed, state_bytes  # noqa: E402
from megatron_offload import attach_offloader  # noqa: E402
from megatron_offload.core.host_memory import HostSlab  # noqa: E402
from megatron_offload.core.units import cap_below_peak  # noqa: E402

GB, GIB = 1e9, 2**30

SHAPES = {
    # a micro-batch's forward is far shorter than one one-way copy (fine-tuning-like)
    "short-forward": GPTShape(num_layers=8, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16),
    # many tokens per micro-batch: forward longer than one one-way copy (pretraining-like)
    "long-forward": GPTShape(
        num_layers=4,
        hidden_size=2048,
        ffn_hidden_size=8192,
        num_attention_heads=16,
        seq_length=2048,
        micro_batch_size=16,
    ),  # fmt: skip
    # configs/gpt_0p9b.yaml's GPT (20 layers, hidden 1792; 0.94B parameters, 10.5 GiB of state) with its
    # batch: 4 micro-batches of 2 x 2048
    "pretraining-0.9b": GPTShape(
        num_layers=20,
        hidden_size=1792,
        ffn_hidden_size=7168,
        num_attention_heads=14,
        vocab_size=32000,
        seq_length=2048,
        micro_batch_size=2,
        num_micro_batches=4,
    ),
}
CAPPED_VARIANTS = ("no offload", "auto", "finalize", "step (streamed)")
WARMUP = 2  # iterations left out of every figure (the first builds the plan and pins the slab)
HYBRID = {  # megatron-core's --optimizer-cpu-offload, whole state on the CPU
    "optimizer_cpu_offload": True,
    "use_precision_aware_optimizer": True,
    "optimizer_offload_fraction": 1.0,
    "overlap_cpu_optimizer_d2h_h2d": True,
}


def pinned_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median GB/s of plain pinned copies of ``nbytes``: each direction alone, and both at once."""
    slab = HostSlab(nbytes // 4, torch.float32, pin=True)  # the slab unpins when dropped: keep it
    assert slab.pinned, "could not pin host memory for the bandwidth reference"
    host, device = slab.tensor, torch.empty(nbytes // 4, device="cuda").normal_()
    device_in = torch.empty_like(device)
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def seconds(copies: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for destination, source, stream in copies:
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    out, back = [(host, device, streams[0])], [(device_in, host, streams[1])]
    result = {}
    for name, copies in (("d2h", out), ("h2d", back), ("both", out + back)):
        result[f"{name}_GBps"] = nbytes * len(copies) / statistics.median(seconds(copies) for _ in range(repeats)) / GB
    return result


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


def with_ratios(rows: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    for row in rows.values():
        if "error" not in row:
            row["step_time_ratio"] = row["median_step_s"] / base["median_step_s"]
            row["peak_saving_GiB"] = base["peak_allocated_GiB"] - row["peak_allocated_GiB"]
            row["peak_reserved_saving_GiB"] = base["peak_reserved_GiB"] - row["peak_reserved_GiB"]
            row["between_steps_saving_GiB"] = base["allocated_between_steps_GiB"] - row["allocated_between_steps_GiB"]
    return rows


def bench_shape(shape: GPTShape, steps: int, variants: list[str], cap: bool) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in ("no offload", "auto", "naive synchronous", "HybridDeviceOptimizer", *variants):
        if name not in rows:
            rows[name] = run_variant(shape, steps, name)
    base = with_ratios(rows, rows["no offload"])["no offload"]
    ours = rows["auto"]
    capped = {}
    if cap:
        # As on a GPU too small for the model: the no-offload peak less 90% of the state.
        limit = int(cap_below_peak(base["peak_allocated_abs_GiB"], base["state_GiB"]) * GIB)
        capped = {"cap_GiB": limit / GIB, "variants": {}}
        for name in CAPPED_VARIANTS:
            capped["variants"][name] = run_variant(shape, steps, name, cap=limit)
        with_ratios(capped["variants"], base)  # ratios to the uncapped no-offload run
    pinned = pinned_bandwidth(int(ours["offloaded_GB"] * GB))
    # fwd+bwd of one micro-batch is about 3 forwards; the step's own time is small beside them
    forward_s = base["median_step_s"] / (3 * shape.num_micro_batches)
    return {
        "shape": vars(shape),
        "pinned_copy": pinned,
        "estimated_forward_per_micro_batch_s": forward_s,
        "one_way_copy_s": ours["offloaded_GB"] * GB / (pinned["d2h_GBps"] * GB),
        "variants": rows,
        "capped": capped,
        "acceptance": acceptance(rows, pinned),
    }


def acceptance(rows: dict[str, Any], pinned: dict[str, float]) -> dict[str, float]:
    """The figures ``auto`` prefetch is judged by, from this run alone."""
    names = ("auto", "no offload", "naive synchronous", "HybridDeviceOptimizer")
    auto, base, naive, hybrid = (rows[name] for name in names)
    one_transfer_s = auto["offloaded_GB"] / (pinned["both_GBps"] / 2)  # per direction, both running
    state_GiB = auto["offloaded_GB"] * GB / GIB
    figures = {
        "added_s": auto["median_step_s"] - base["median_step_s"],
        "one_transfer_s": one_transfer_s,
        "added_over_one_transfer": (auto["median_step_s"] - base["median_step_s"]) / one_transfer_s,
        "overhead": auto["step_time_ratio"] - 1,
        "peak_saving_vs_naive": auto["peak_saving_GiB"] / naive["peak_saving_GiB"] if naive["peak_saving_GiB"] else 0.0,
        "peak_saving_vs_state": auto["peak_saving_GiB"] / state_GiB,
        "speedup_vs_naive": naive["median_step_s"] / auto["median_step_s"],
        "copy_out_vs_pinned": auto["copy_out_GBps"] / pinned["d2h_GBps"],
        "copy_back_vs_pinned": auto["copy_back_GBps"] / pinned["h2d_GBps"],
        # where the two directions overlap, each gets its share of what both at once give
        "copy_out_vs_pinned_both": auto["copy_out_GBps"] / (pinned["both_GBps"] / 2),
        "copy_back_vs_pinned_both": auto["copy_back_GBps"] / (pinned["both_GBps"] / 2),
    }
    if "error" not in hybrid:
        figures["speedup_vs_hybrid"] = hybrid["median_step_s"] / auto["median_step_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--cap", action="store_true", help="run again under a cap: no-offload peak - 90%% of the state")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if ALLOCATOR_NOTE:
        print(ALLOCATOR_NOTE)
    init_distributed()
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "megatron_core": version("megatron-core"),
        "commit": os.environ.get("MEGATRON_OFFLOAD_COMMIT", "unknown"),  # the device's tree has no .git
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "shapes": {},
    }
    for name in args.shapes:
        results["shapes"][name] = bench_shape(SHAPES[name], args.steps, args.variants, args.cap)
    print(json.dumps(results, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1, default=str)


if __name__ == "__main__":
    main()
