"""How long does a 4-byte ``.item()`` wait when it is issued right after an optimizer step that offloads
the state? Megatron-LM reads a GPU value right after every ``optimizer.step()``.

The copy engine serves device-to-host copies in the order they were queued, so a read queued behind
the whole copy out waits for all of it. Side by side, on the same state (Adam, fp32 masters):
- ``all at once``: every chunk's copy out queued on a side stream in one go (the old design);
- ``offloader, step``: the offloader's streamed step (every chunk comes back through it);
- ``offloader, finalize``: every chunk back before the step, so the whole state leaves after it
  (queued by the step, started a few at a time by the training loop's next points).
The read is timed after the compute stream has finished the step (its own work is not counted).

    python -m benchmarks.copy_order_probe [--state-gb 8.4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.core.host_memory import HostSlab
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper

GB = 1e9
PARAM_NUMEL = 4 * 1024**2  # 16 MiB fp32 masters: a chunk holds a few masters with their moments


def timed_read(small: torch.Tensor) -> float:
    """Milliseconds a 4-float ``.item()`` takes once the compute stream is done with earlier work."""
    done = torch.cuda.Event()
    done.record()
    done.synchronize()  # what is left is the read itself, and whatever copies it queues behind
    start = time.perf_counter()
    small.sum().item()
    return 1e3 * (time.perf_counter() - start)


def all_at_once(nbytes: int, small: torch.Tensor, repeats: int) -> dict[str, float]:
    slab = HostSlab(nbytes, torch.uint8, pin=True)  # keep the object: the slab unpins when dropped
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side, piece = torch.cuda.Stream(), 64 * 1024**2
    waits, seconds = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        start = time.perf_counter()
        with torch.cuda.stream(side):
            for offset in range(0, nbytes, piece):
                slab.tensor[offset : offset + piece].copy_(device[offset : offset + piece], non_blocking=True)
        waits.append(timed_read(small))
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"read_wait_ms": statistics.median(waits), "copy_out_GBps": nbytes / statistics.median(seconds) / GB}


def offloader_run(state_gb: float, prefetch: str, small: torch.Tensor, repeats: int) -> dict[str, float]:
    count = max(1, int(state_gb * GB / 12 / PARAM_NUMEL))  # 12 bytes a parameter: master and two moments
    masters = [torch.nn.Parameter(torch.randn(PARAM_NUMEL, device="cuda")) for _ in range(count)]
    optimizer = torch.optim.AdamW(masters, lr=1e-4)
    offloader = OptimizerStateOffloader(optimizer, masters)
    stepper = ChunkStepper(optimizer)
    offloader.offload()
    waits, drains = [], []
    for step in range(repeats + 1):  # the first step creates Adam's moments
        if prefetch == "finalize":
            offloader.prefetch()
            offloader.copies.flush()  # as the finalize hook does: every copy back starts at once
        with offloader.device_view.params_on_device():  # offloaded masters look like GPU tensors: grads can be assigned
            for master in masters:
                master.grad = torch.randn(master.shape, device="cuda")
            streamed_step.run(offloader, stepper)
        wait = timed_read(small)
        start = time.perf_counter()
        pending = offloader.leaving_bytes
        offloader.copies.drain()
        if step:
            waits.append(wait)
            drains.append(pending / max(time.perf_counter() - start, 1e-9) / GB)
    state = offloader.read_stats().host_bytes
    offloader.restore()
    return {
        "state_GB": state / GB,
        "read_wait_ms": statistics.median(waits),
        "read_wait_max_ms": max(waits),
        "drain_after_step_GBps": statistics.median(drains),
    }


READ_WAIT_LIMIT_MS = 5.0  # the bar for a 4-byte read right after a step that offloads >= 8 GB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-gb", type=float, default=8.4, help="offloaded state, GB (default 8.4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    small = torch.ones(4, device="cuda")
    results = {
        "device": torch.cuda.get_device_name(),
        "commit": os.environ.get("MEGATRON_OFFLOAD_COMMIT", "unknown"),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "(default)"),
        "offloader, step": offloader_run(args.state_gb, "step", small, args.repeats),
        "offloader, finalize": offloader_run(args.state_gb, "finalize", small, args.repeats),
    }
    results["all at once"] = all_at_once(int(results["offloader, step"]["state_GB"] * GB), small, args.repeats)
    for name, figures in results.items():
        print(f"{name}: {figures}")
    worst = max(results[name]["read_wait_max_ms"] for name in ("offloader, step", "offloader, finalize"))
    results["read_wait_limit_ms"], results["passed"] = READ_WAIT_LIMIT_MS, worst <= READ_WAIT_LIMIT_MS
    print(
        f"longest read right after a step: {worst:.2f} ms (limit {READ_WAIT_LIMIT_MS} ms): "
        + ("ok" if results["passed"] else "TOO LONG")
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
