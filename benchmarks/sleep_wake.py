"""Sleep/wake acceptance run on one GPU: configs/gpt_0p9b.yaml's GPT after a few training steps.

In one process: the pinned link bandwidth (plain copies, each direction); our sleep and wake of the
optimizer state with masters, the gradient buffers and the bf16 param buffers (two cycles: the first
pins the host slabs, the second reuses them, as every later RL rollout does), each part timed on its
own and the device's free memory read around it; then megatron-core's own ``offload_to_cpu()`` /
``restore_from_cpu()`` plus the buffers' ``offload_to_cpu()`` / ``reload_from_cpu()`` on the same
model, timed and measured the same way. Checks (exit 1 if one fails): in the second cycle every part
at least 80% of the link in each direction, and the free memory rose by at least 95% of the bytes moved.

    PYTHONPATH=$PWD:$MEGATRON python benchmarks/sleep_wake.py --json results/sleep-wake-h100/result.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from megatron_offload.gpu_memory import use_expandable_segments_by_default

ALLOCATOR_NOTE = use_expandable_segments_by_default()  # before CUDA starts, as our entry points do

import torch  # noqa: E402

from megatron_offload import sleep_wake_for  # noqa: E402
from megatron_offload.host_memory import HostSlab  # noqa: E402
from tests.gpu import harness  # noqa: E402

GB, GIB = 1e9, 2**30
# configs/gpt_0p9b.yaml: 20 layers, hidden 1792, ffn 7168, 14 heads, seq 2048, vocab 50257 padded to
# 50304, untied embeddings; micro-batch 2, 4 micro-batches.
SHAPE = harness.GPTShape(
    num_layers=20,
    hidden_size=1792,
    num_attention_heads=14,
    ffn_hidden_size=7168,
    vocab_size=50304,
    seq_length=2048,
    micro_batch_size=2,
    num_micro_batches=4,
)
MIN_LINK_FRACTION, MIN_FREED_FRACTION = 0.80, 0.95


def pinned_link(nbytes: int = 4 * GIB, repeats: int = 5) -> dict[str, float]:
    """Median GB/s of one plain copy of ``nbytes`` between the device and pinned host memory."""
    slab = HostSlab(nbytes, torch.uint8, pin=True)
    assert slab.pinned, "could not pin host memory for the link reference"
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def seconds(destination: torch.Tensor, source: torch.Tensor) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        destination.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    out = statistics.median(seconds(slab.tensor, device) for _ in range(repeats))
    back = statistics.median(seconds(device, slab.tensor) for _ in range(repeats))
    del device
    slab.release()
    torch.cuda.empty_cache()
    return {"d2h_GBps": nbytes / out / GB, "h2d_GBps": nbytes / back / GB}


def ours(training: harness.GPTTraining, iteration: int) -> list[dict]:
    """Two sleep/wake cycles with a training step between them; then everything back for good."""
    sleeper = sleep_wake_for(training.optimizer)
    cycles = []
    for cycle in range(2):
        torch.cuda.synchronize()
        asleep = sleeper.sleep(optimizer=True, grads=True, params=True)
        awake = sleeper.wake()
        cycles.append(
            {
                "cycle": cycle + 1,
                "sleep": {t.part: {"bytes": t.nbytes, "s": t.seconds, "GBps": t.gb_per_s} for t in asleep.transfers},
                "wake": {t.part: {"bytes": t.nbytes, "s": t.seconds, "GBps": t.gb_per_s} for t in awake.transfers},
                "bytes": asleep.nbytes,
                "sleep_s": asleep.seconds,
                "wake_s": awake.seconds,
                "device_free_rise_bytes": asleep.device_free_after - asleep.device_free_before,
            }
        )
        training.train_step(iteration + cycle)  # ready for the next step, bitwise (tests/gpu/test_sleep.py)
    sleeper.close()
    return cycles


def megatron_core(training: harness.GPTTraining) -> list[dict]:
    """megatron-core's own calls (as its RL path and verl use them), two cycles, timed the same way."""
    buffers = [b for chunk in training.model for b in chunk.buffers + chunk.expert_parallel_buffers]
    cycles = []
    for cycle in range(2):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as ours: only what the offload gives back counts
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        training.optimizer.offload_to_cpu()
        middle = time.perf_counter()
        for buffer in buffers:
            buffer.offload_to_cpu(move_params=True, move_grads=True)
        torch.cuda.synchronize()  # its param copy is non-blocking
        torch.cuda.empty_cache()
        offloaded = time.perf_counter()
        free_after = torch.cuda.mem_get_info()[0]
        for buffer in buffers:
            buffer.reload_from_cpu(move_params=True, move_grads=True)
        torch.cuda.synchronize()
        reloaded = time.perf_counter()
        training.optimizer.restore_from_cpu()
        torch.cuda.synchronize()
        restored = time.perf_counter()
        cycles.append(
            {
                "cycle": cycle + 1,
                "optimizer_offload_to_cpu_s": middle - start,
                "buffers_offload_to_cpu_s": offloaded - middle,
                "buffers_reload_from_cpu_s": reloaded - offloaded,
                "optimizer_restore_from_cpu_s": restored - reloaded,
                "offload_s": offloaded - start,
                "restore_s": restored - offloaded,
                "device_free_rise_bytes": free_after - free_before,
                "note": "grad buffers are freed and zeroed, not copied",
            }
        )
    return cycles


def checks(link: dict[str, float], cycle: dict) -> list[str]:
    failures = []
    for direction, key in (("sleep", "d2h_GBps"), ("wake", "h2d_GBps")):
        for part, moved in cycle[direction].items():
            if moved["GBps"] < MIN_LINK_FRACTION * link[key]:
                failures.append(f"{direction} {part}: {moved['GBps']:.1f} GB/s < 80% of {link[key]:.1f} GB/s")
    if cycle["device_free_rise_bytes"] < MIN_FREED_FRACTION * cycle["bytes"]:
        failures.append(
            f"free memory rose {cycle['device_free_rise_bytes'] / GIB:.2f} GiB for {cycle['bytes'] / GIB:.2f}"
        )
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=Path("results/sleep-wake/result.json"))
    parser.add_argument("--steps", type=int, default=3, help="training steps before the first sleep")
    args = parser.parse_args()
    # The harness's GPTModel ties embeddings by default; the config unties them.
    harness.GPTModel = functools.partial(harness.GPTModel, share_embeddings_and_output_weights=False)
    harness.init_distributed()
    link = pinned_link()
    training = harness.build_gpt_training(SHAPE, lr=1e-4, clip_grad=1.0)
    losses = [training.train_step(i)[0] for i in range(args.steps)]
    result = {
        "device": torch.cuda.get_device_name(),
        "megatron_core_version": version("megatron-core"),
        "torch": torch.__version__,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "command": " ".join([sys.executable, *sys.argv]),
        "allocator": ALLOCATOR_NOTE or "as configured by PYTORCH_CUDA_ALLOC_CONF",
        "parameters": sum(p.numel() for p in training.model[0].parameters()),
        "state_bytes": harness.state_bytes(training),
        "losses": losses,
        "pinned_link": link,
        "ours": ours(training, args.steps),
        "megatron_core": megatron_core(training),
    }
    result["failures"] = checks(link, result["ours"][-1])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses",)}, indent=2))
    print("PASS" if not result["failures"] else "FAIL:\n" + "\n".join(result["failures"]))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
