"""Sleep/wake acceptance run on one GPU: configs/gpt_0p9b.yaml's GPT, in the order an RL job meets it.

In one process: the pinned link (plain 4 GiB copies each way, median of 5: the reference every figure
is held against); the GPT built and ``sleep_wake_for(...).prepare(optimizer, grads, params)`` at setup
(the host memory pinned ahead, GiB and GiB/s); ``--steps`` training steps; then ``--cycles`` cycles of
sleep (optimizer state with masters, gradient buffers, bf16 param buffers), wake and one training step,
the first cycle included, each part timed on the link in each direction (CUDA events) and the device's
free memory read around each sleep; then megatron-core's own ``offload_to_cpu()`` /
``restore_from_cpu()`` plus the buffers' ``offload_to_cpu()`` / ``reload_from_cpu()`` on the same model,
timed and measured the same way.

Checks (exit status 1 if one fails), every cycle: every part at least 80% of the link in each
direction; the whole sleep and the whole wake, wall clock (pinning, allocation and giving memory back
included), at least 80%; the device's free memory rose by at least 95% of the bytes moved.

    python -m benchmarks.sleep_wake --json results/sleep-wake-h100/result.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from megatron_offload.core.gpu_memory import use_expandable_segments_by_default

ALLOCATOR_NOTE = use_expandable_segments_by_default()  # before CUDA starts, as our entry points do

import torch  # noqa: E402

from benchmarks import gpt_training as harness  # noqa: E402
from megatron_offload import MegatronSleeper, sleep_wake_for  # noqa: E402
from megatron_offload.core.host_memory import HostSlab  # noqa: E402
from megatron_offload.sleep.report import SleepReport  # noqa: E402

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
    tie_embeddings=False,
)
MIN_LINK_FRACTION, MIN_FREED_FRACTION = 0.80, 0.95
DIRECTIONS = {"sleep": "d2h_GBps", "wake": "h2d_GBps"}


def pinned_link(nbytes: int = 4 * GIB, repeats: int = 5) -> dict[str, float]:
    """Median GB/s of one plain copy of ``nbytes`` between the device and pinned host memory."""
    slab = HostSlab(nbytes, torch.uint8, pin=True, label="host memory for the link reference")
    assert slab.pinned, "could not pin host memory for the link reference"
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def seconds(destination: torch.Tensor, source: torch.Tensor) -> float:
        torch.cuda.synchronize()  # a clean start: nothing queued before is timed
        start = time.perf_counter()
        destination.copy_(source, non_blocking=True)
        torch.cuda.synchronize()  # landed: the time is the copy's
        return time.perf_counter() - start

    out = statistics.median(seconds(slab.tensor, device) for _ in range(repeats))
    back = statistics.median(seconds(device, slab.tensor) for _ in range(repeats))
    del device
    slab.release()
    torch.cuda.empty_cache()
    return {"d2h_GBps": nbytes / out / GB, "h2d_GBps": nbytes / back / GB}


def parts_of(report: SleepReport, link: float) -> dict[str, dict]:
    return {
        t.part: {
            "bytes": t.nbytes,
            "s": t.seconds,
            "GBps": t.gb_per_s,
            "of_link": t.gb_per_s / link,
            "setup_s": t.setup_seconds,
        }
        for t in report.transfers
        if t.nbytes
    }


def ours(
    training: harness.GPTTraining, sleeper: MegatronSleeper, link: dict[str, float], cycles: int, first: int
) -> list[dict]:
    """``cycles`` sleep/wake cycles, each followed by a training step (bitwise as without the pause:
    tests/gpu/test_sleep.py); the first cycle is the first sleep of the run."""
    out = []
    for cycle in range(cycles):
        torch.cuda.synchronize()
        asleep = sleeper.sleep(optimizer=True, grads=True, params=True)
        awake = sleeper.wake()
        loss = training.train_step(first + cycle)[0]
        out.append(
            {
                "cycle": cycle + 1,
                "sleep": parts_of(asleep, link["d2h_GBps"]),
                "wake": parts_of(awake, link["h2d_GBps"]),
                "bytes": asleep.nbytes,
                "sleep_s": asleep.seconds,
                "sleep_GBps": asleep.gb_per_s,
                "wake_s": awake.seconds,
                "wake_GBps": awake.gb_per_s,
                "pinned_on_the_way_bytes": sum(t.nbytes for t in asleep.pinned),
                "device_free_rise_bytes": asleep.given_back,
                "held_by_allocator_bytes": asleep.held_by_allocator,
                "loss_after": loss,
                "sleep_line": asleep.describe(),
                "wake_line": awake.describe(),
            }
        )
        print(f"cycle {cycle + 1}: sleep {asleep.describe()}\n         wake {awake.describe()}", flush=True)
    return out


def megatron_core(training: harness.GPTTraining, state_bytes: int, param_bytes: int) -> list[dict]:
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
                "optimizer_offload_GBps": state_bytes / (middle - start) / GB,
                "buffers_offload_to_cpu_s": offloaded - middle,
                "params_offload_GBps": param_bytes / (offloaded - middle) / GB,
                "buffers_reload_from_cpu_s": reloaded - offloaded,
                "params_reload_GBps": param_bytes / (reloaded - offloaded) / GB,
                "optimizer_restore_from_cpu_s": restored - reloaded,
                "optimizer_restore_GBps": state_bytes / (restored - reloaded) / GB,
                "offload_s": offloaded - start,
                "restore_s": restored - offloaded,
                "device_free_rise_bytes": free_after - free_before,
                "note": "grad buffers are freed and zeroed, not copied",
            }
        )
        print(f"megatron-core cycle {cycle + 1}: {json.dumps(cycles[-1])}", flush=True)
    return cycles


def checks(link: dict[str, float], cycle: dict) -> list[str]:
    failures, name = [], f"cycle {cycle['cycle']}"
    for direction, key in DIRECTIONS.items():
        for part, moved in cycle[direction].items():
            if moved["of_link"] < MIN_LINK_FRACTION:
                failures.append(
                    f"{name} {direction} {part}: {moved['GBps']:.1f} GB/s = {moved['of_link']:.0%} of the link's "
                    f"{link[key]:.1f} GB/s"
                )
        rate = cycle[f"{direction}_GBps"]
        if rate < MIN_LINK_FRACTION * link[key]:
            failures.append(f"{name} {direction}, wall clock: {rate:.1f} GB/s = {rate / link[key]:.0%} of the link")
    if cycle["device_free_rise_bytes"] < MIN_FREED_FRACTION * cycle["bytes"]:
        failures.append(
            f"{name}: free memory rose {cycle['device_free_rise_bytes'] / GIB:.2f} GiB for {cycle['bytes'] / GIB:.2f}"
            " GiB moved"
        )
    return failures


def commit() -> str:
    """The device machine's copy of the tree has no .git: MEGATRON_OFFLOAD_COMMIT passes it in."""
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return os.environ.get("MEGATRON_OFFLOAD_COMMIT") or found.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=Path("results/sleep-wake/result.json"))
    parser.add_argument("--steps", type=int, default=3, help="training steps before the first sleep")
    parser.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles of ours, the first included")
    args = parser.parse_args()
    harness.init_distributed()
    link = pinned_link()
    print(f"pinned link: {link['d2h_GBps']:.1f} GB/s to host, {link['h2d_GBps']:.1f} GB/s to the GPU", flush=True)
    training = harness.build_gpt_training(SHAPE, lr=1e-4, clip_grad=1.0)
    sleeper = sleep_wake_for(training.optimizer)
    prepared = sleeper.prepare(optimizer=True, grads=True, params=True)  # at setup, as an RL framework does
    print(f"prepare: {prepared.describe()}", flush=True)
    losses = [training.train_step(i)[0] for i in range(args.steps)]
    result = {
        "device": torch.cuda.get_device_name(),
        "megatron_core_version": version("megatron-core"),
        "torch": torch.__version__,
        "commit": commit(),
        "command": " ".join(["python", *sys.argv]),
        "allocator": ALLOCATOR_NOTE or f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}",
        "parameters": sum(p.numel() for p in training.model[0].parameters()),
        "state_bytes": harness.state_bytes(training),
        "losses": losses,
        "pinned_link": link,
        "prepare": {
            t.part: {"bytes": t.nbytes, "s": t.seconds, "GiBps": t.nbytes / GIB / t.seconds if t.seconds else 0.0}
            for t in prepared.transfers
        },
        "ours": ours(training, sleeper, link, args.cycles, args.steps),
    }
    sleeper.close()
    param_bytes = sum(b.param_data.numel() * b.param_data.element_size() for b in training.model[0].buffers)
    result["megatron_core"] = megatron_core(training, result["state_bytes"], param_bytes)
    result["failures"] = [failure for cycle in result["ours"] for failure in checks(link, cycle)]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "ours")}, indent=2))
    for cycle in result["ours"]:
        for direction in DIRECTIONS:
            parts = ", ".join(
                f"{part} {moved['GBps']:.1f} GB/s ({moved['of_link']:.0%})" for part, moved in cycle[direction].items()
            )
            print(f"cycle {cycle['cycle']} {direction}: {parts}; wall {cycle[f'{direction}_GBps']:.1f} GB/s")
        rose = cycle["device_free_rise_bytes"] / cycle["bytes"]
        print(f"cycle {cycle['cycle']}: free memory rose by {rose:.1%} of the bytes moved")
    print("PASS" if not result["failures"] else "FAIL:\n" + "\n".join(result["failures"]))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
