"""Side by side on one GPU: a megatron-core GPT trained without and with offloading, plus the raw
pinned copy bandwidth of the same machine, so the offloader's copies can be read as a fraction of it.

    PYTHONPATH=/tmp/site:. python benchmarks/offload_bandwidth.py --json results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from megatron_offload import attach_offloader
from megatron_offload.host_memory import HostSlab
from tests.gpu.harness import GPTShape, build_gpt_training, init_distributed

GB = 1e9


def pinned_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median GB/s of plain pinned copies of ``nbytes``: each direction alone, and both at once."""
    slab = HostSlab(nbytes // 4, torch.float32, pin=True)  # the slab unpins when dropped: keep it
    assert slab.pinned, "could not pin host memory for the bandwidth reference"
    host = slab.tensor
    device = torch.empty_like(host, device="cuda").normal_()
    device_in = torch.empty_like(device)
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(copies: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for destination, source, stream in copies:
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    out = [(host, device, streams[0])]
    back = [(device_in, host, streams[1])]
    results = {}
    for name, copies in (("d2h", out), ("h2d", back), ("both", out + back)):
        seconds = statistics.median(timed(copies) for _ in range(repeats))
        results[f"{name}_GBps"] = nbytes / seconds / GB * (2 if name == "both" else 1)
    results["both_per_direction_GBps"] = results["both_GBps"] / 2
    return results


def run(shape: GPTShape, steps: int, offload: bool) -> dict[str, float]:
    """Train ``steps`` iterations; memory figures count only what this run allocated."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    training = build_gpt_training(shape)
    handle = attach_offloader(training.optimizer) if offload else None
    step_seconds, offload_seconds, prefetch_seconds = [], [], []
    torch.cuda.reset_peak_memory_stats()
    for iteration in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        training.train_step(iteration)
        torch.cuda.synchronize()
        step_seconds.append(time.perf_counter() - start)
        if handle is not None:
            stats = handle.read_stats()
            offload_seconds.append(stats.last_offload_seconds)
            prefetch_seconds.append(stats.last_prefetch_seconds)
    result = {
        "median_step_s": statistics.median(step_seconds[2:]),
        "peak_allocated_GiB": (torch.cuda.max_memory_allocated() - before) / 2**30,
        "allocated_between_steps_GiB": (torch.cuda.memory_allocated() - before) / 2**30,
    }
    if handle is not None:
        stats = handle.read_stats()
        result |= {
            "offloaded_GB": stats.gpu_bytes_freed / GB,
            "offload_copy_s": statistics.median(offload_seconds[2:]),
            "prefetch_copy_s": statistics.median(prefetch_seconds[2:]),
            "pinned": stats.pinned,
        }
        handle.detach()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    init_distributed()
    shape = GPTShape(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden, num_attention_heads=16
    )
    baseline = run(shape, args.steps, offload=False)
    offloaded = run(shape, args.steps, offload=True)
    nbytes = int(offloaded["offloaded_GB"] * GB)
    pinned = pinned_bandwidth(nbytes)
    offload_GBps = offloaded["offloaded_GB"] / offloaded["offload_copy_s"]
    prefetch_GBps = offloaded["offloaded_GB"] / offloaded["prefetch_copy_s"]
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": vars(shape) if hasattr(shape, "__dict__") else str(shape),
        "baseline": baseline,
        "offload": offloaded,
        "pinned_copy": pinned,
        "offload_GBps": offload_GBps,
        "prefetch_GBps": prefetch_GBps,
        "offload_fraction_of_pinned_d2h": offload_GBps / pinned["d2h_GBps"],
        "prefetch_fraction_of_pinned_h2d": prefetch_GBps / pinned["h2d_GBps"],
        "step_time_ratio": offloaded["median_step_s"] / baseline["median_step_s"],
        "allocated_saving_GiB": baseline["allocated_between_steps_GiB"] - offloaded["allocated_between_steps_GiB"],
        "peak_saving_GiB": baseline["peak_allocated_GiB"] - offloaded["peak_allocated_GiB"],
    }
    print(json.dumps(summary, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(summary, file, indent=2, default=str)


if __name__ == "__main__":
    main()
