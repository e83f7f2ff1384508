"""The optimizer-state offloader's streamed step beside the host link, on one GPU, without Megatron.

A torch AdamW over fp32 masters shaped like a GPT config's parameters (each one a tensor of its own, as
DistributedOptimizer's masters are at one data-parallel rank), the offloader keeping ``1 - fraction`` of the
state on the GPU. Per row, after two warm-up steps, the median of ``--steps`` steps of:
- ``step``: ``streamed_step.run``, then every copy it left pending started (as the next forward would);
  GPU ms from the step's start to its last copy landed, and the host's ms inside ``run``;
- ``no offload``: the same optimizer's own step with the whole state on the GPU;
- ``copies``: only the streamed step's copies, through the same staging buffers and the same orders on
  the device (chunk i+2 in once chunk i-1 is out), no update: what the pipeline gives the link.
The link is measured first (``benchmarks/link_speed.py``): in, out, both at once. The floor of a row is its
bytes each way over the link, both directions at once, plus nothing for the update (it hides behind them).

    python -m benchmarks.streamed_step_speed --config configs/gpt_0p9b.yaml --fraction 0.9 \
        --chunk-mb 64 128 --staging 3 4 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from megatron_offload.core.gpu_memory import use_expandable_segments_by_default

ALLOCATOR_NOTE = use_expandable_segments_by_default()  # before CUDA starts, as our entry points do

import torch  # noqa: E402
import yaml  # noqa: E402

from benchmarks import link_speed  # noqa: E402
from megatron_offload.core.units import MIB  # noqa: E402
from megatron_offload.optimizer_state import streamed_step  # noqa: E402
from megatron_offload.optimizer_state.chunk_step import ChunkStepper  # noqa: E402
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader  # noqa: E402

GB = 1e9


def gpt_shapes(config: dict[str, Any]) -> list[tuple[int, ...]]:
    """The parameter shapes of Megatron's GPT with the local spec (biases, two LayerNorms a layer, learned
    positions, an output layer of its own where untied), the vocabulary padded to a multiple of 128."""
    h, f = int(config["hidden-size"]), int(config.get("ffn-hidden-size", 4 * int(config["hidden-size"])))
    vocab = -(-int(config.get("vocab-size", 50257)) // 128) * 128
    layer = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (f, h), (f,), (h, f), (h,)]
    shapes = [(vocab, h), (int(config.get("max-position-embeddings", config["seq-length"])), h)]
    shapes += layer * int(config["num-layers"]) + [(h,), (h,)]
    return shapes + [(vocab, h)] if config.get("untie-embeddings-and-output-weights") else shapes


def build(shapes: list[tuple[int, ...]]) -> tuple[torch.optim.AdamW, list[torch.nn.Parameter]]:
    masters = [torch.nn.Parameter(torch.randn(shape, device="cuda") * 0.02) for shape in shapes]
    for master in masters:
        master.grad = torch.randn_like(master) * 1e-3
    return torch.optim.AdamW(masters, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1), masters


def timed(run, steps: int) -> dict[str, float]:
    """GPU ms (events around ``run`` and what it leaves queued) and the host's ms inside ``run``."""
    gpu, host = [], []
    for index in range(steps + 2):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        run()
        spent = time.perf_counter() - began
        end.record()  # after run's own waits for its copies (see step_row)
        torch.cuda.synchronize()
        if index >= 2:
            gpu.append(start.elapsed_time(end))
            host.append(spent * 1e3)
    return {"gpu_ms": round(statistics.median(gpu), 1), "host_ms": round(statistics.median(host), 1)}


def step_row(optimizer, masters, fraction: float, chunk_mb: int, staging: int, steps: int) -> dict[str, Any]:
    default, streamed_step.STAGING_CHUNKS = streamed_step.STAGING_CHUNKS, staging  # read at each run
    try:
        return _step_row(optimizer, masters, fraction, chunk_mb, steps)
    finally:
        streamed_step.STAGING_CHUNKS = default


def _step_row(optimizer, masters, fraction: float, chunk_mb: int, steps: int) -> dict[str, Any]:
    optimizer.step()  # Adam's moments exist: the plan holds all of the state from the start
    off = OptimizerStateOffloader(optimizer, masters, chunk_bytes=chunk_mb * MIB, fraction=fraction)
    off.offload(now=True)
    off.copies.drain()
    stepper = ChunkStepper(optimizer)

    def run() -> None:
        streamed_step.run(off, stepper)
        # Every copy out starts and the compute stream waits for it on the device, as a forward that needs
        # the memory would: the row's end event counts them.
        off.copies.release()

    figures = timed(run, steps)
    off.copies.drain()
    moved, chunks = off.offloaded_bytes, len(off.chunks)
    off.restore()
    figures |= {"moved_GB": round(moved / GB, 2), "chunks": chunks}
    figures["GBps_each_way"] = round(moved / GB / (figures["gpu_ms"] / 1e3), 1)
    return figures


def copies_row(host: tuple[torch.Tensor, torch.Tensor], chunk_mb: int, staging: int, steps: int) -> dict[str, Any]:
    """The streamed step's copies alone, between the pinned ``host`` pair: chunk i+2 comes in once chunk
    i-1 has left its buffer."""
    host_in, host_out = host
    size = chunk_mb * MIB
    count = max(1, host_in.numel() // size)
    buffers = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(staging)]
    inward, outward = torch.cuda.Stream(), torch.cuda.Stream()

    def run() -> None:
        landed, left = [None] * count, [None] * count
        compute = torch.cuda.current_stream()
        start = compute.record_event()

        def bring(index: int) -> None:
            before = index - staging
            inward.wait_event(left[before] if before >= 0 else start)  # its buffer has been read out
            with torch.cuda.stream(inward):
                buffers[index % staging].copy_(host_in[index * size : (index + 1) * size], non_blocking=True)
                landed[index] = inward.record_event()

        for index in range(min(staging - 1, count)):
            bring(index)
        for index in range(count):
            outward.wait_event(landed[index])  # the update would run here, on the compute stream
            with torch.cuda.stream(outward):
                host_out[index * size : (index + 1) * size].copy_(buffers[index % staging], non_blocking=True)
                left[index] = outward.record_event()
            if index + staging - 1 < count:
                bring(index + staging - 1)
        compute.wait_event(left[-1])  # the row's end event counts every copy

    figures = timed(run, steps)
    figures["GBps_each_way"] = round(count * size / GB / (figures["gpu_ms"] / 1e3), 1)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gpt_0p9b.yaml")
    parser.add_argument("--fraction", type=float, default=0.9, help="share of the state streamed through the step")
    parser.add_argument("--chunk-mb", type=int, nargs="+", default=[64])
    parser.add_argument("--staging", type=int, nargs="+", default=[streamed_step.STAGING_CHUNKS])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the rows here as well")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("streamed_step_speed: no CUDA GPU here: run it on the GPU machine", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "link": link_speed.measure()}
    print(json.dumps(result), flush=True)
    optimizer, masters = build(gpt_shapes(yaml.safe_load(Path(args.config).read_text())))
    result["no offload"] = timed(optimizer.step, args.steps)
    print(json.dumps({"no offload": result["no offload"]}), flush=True)
    state = sum(3 * m.numel() * 4 for m in masters)
    moved = int(args.fraction * state)
    host = tuple(torch.empty(moved, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    for chunk_mb in args.chunk_mb:
        for staging in args.staging:
            name = f"{chunk_mb} MiB x {staging}"
            row = step_row(optimizer, masters, args.fraction, chunk_mb, staging, args.steps)
            row["copies"] = copies_row(host, chunk_mb, staging, args.steps)
            row["floor_ms"] = round(2 * row["moved_GB"] / result["link"]["both_GBps"] * 1e3, 1)
            result[name] = row
            print(json.dumps({name: row}), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
