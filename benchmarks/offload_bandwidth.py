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
import json
import os
import statistics
import time
from importlib.metadata import version
from typing import Any

from megatron_offload.core.gpu_memory import use_expandable_segments_by_default

ALLOCATOR_NOTE = use_expandable_segments_by_default()  # before CUDA starts, as our entry points do

import torch  # noqa: E402

from benchmarks.gpt_training import GPTShape, init_distributed  # noqa: E402
from benchmarks.offload_variants import GB, GIB, VARIANTS, run_variant  # noqa: E402
from megatron_offload.core.host_memory import HostSlab  # noqa: E402
from megatron_offload.core.units import cap_below_peak  # noqa: E402

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
