"""One Megatron training job under torchrun, and its figures from the log: time per iteration (the slow
first iterations left out, ``steady``), losses, our log line's offload fields, peaks, and why a job that failed did not
run. megatron_side_by_side.py's rows and sweep and weight_streaming.py's rows each run through ``run``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import phase_lines
from benchmarks.host_pace import logged_span
from benchmarks.memory_report import GIB, MIB, parse_log
from benchmarks.memory_speed_curve import MEDIAN_FROM
from benchmarks.run_logs import did_not_fit, failure_reason, logged_link_gbps
from megatron_offload.config.files import needs_one_connection

ROOT = Path(__file__).resolve().parents[1]


def steady(iterations: list[int]) -> list[int]:
    """The logged iterations a median of time per iteration counts: at ``--log-interval`` 1, iterations 3 on;
    at k > 1 (each line the mean of the k iterations before it), the lines from 2k on, as the memory-speed
    sweep counts them. The interval is read from the logged numbers; where nothing qualifies, all but the
    first line (or that one alone)."""
    if len(iterations) >= 2:
        gaps = [b - a for a, b in zip(iterations, iterations[1:], strict=False)]
        interval = max(set(gaps), key=gaps.count)
    else:
        interval = 1
    counted = [i for i in iterations if i >= max(MEDIAN_FROM, 2 * interval)]
    return counted or iterations[1:] or iterations


def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One training job under torchrun; its figures from the log. ``env_extra`` (upstream's rows) is
    written at the head of the log with the command, so that a log says how it was run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", **(env_extra or {})}
    if needs_one_connection(argv):
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core requires it with TP or CP > 1
    print(f"[{name}] {' '.join(argv)}", flush=True)
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    text = result.stdout + result.stderr
    prefix = "".join(f"{key}={value} " for key, value in (env_extra or {}).items())
    (out / f"{name}.log").write_text("$ " + prefix + " ".join(command) + "\n" + text)
    log = parse_log(text)
    figures: dict[str, Any] = {"argv": argv, "returncode": result.returncode, "wall_s": time.monotonic() - started}
    if log.parameters:  # Megatron's count on each model-parallel rank: the state is 12 bytes a parameter
        figures["parameters"] = max(log.parameters.values())
    if result.returncode != 0 or not log.steps:
        reason = failure_reason(text)
        print(f"[{name}] did not run: {reason}", flush=True)
        return figures | {"error": reason, "did_not_fit": did_not_fit(reason)}
    iterations = sorted(log.steps)
    last = log.steps[iterations[-1]]
    figures |= {
        "losses": {i: log.steps[i].loss for i in iterations},
        "step_ms": statistics.median(log.steps[i].step_ms for i in steady(iterations)),
        "step_ms_per_interval": [log.steps[i].step_ms for i in iterations],
        "step_ms_by_iteration": {i: log.steps[i].step_ms for i in iterations},
        "offloaded_GiB": last.offloaded_gib,
        "exposed_ms": last.exposed_ms,
        "copy_out_in_ms": [last.copy_out_ms, last.copy_in_ms],
        "allocator_retries_by_iteration": {i: log.steps[i].allocator_retries for i in iterations},
        "streamed_GiB_by_iteration": {i: log.steps[i].streamed_gib for i in iterations},
    }
    if span := logged_span(text, steady):  # the host's pace then (host_pace.py)
        figures["counted_span"] = span
    if marked := phase_lines.summary(text):  # run through benchmarks.phases (--phases): GPU and host ms per phase
        figures["phases_ms"] = marked
    wanted = ("micro_batch_size", "global_batch_size", "data_parallel_size")
    figures["megatron_args"] = {key: log.args[key] for key in wanted if key in log.args}
    if link := logged_link_gbps(text):
        figures["link_GBps"] = link
    rank = log.memory_rank
    if rank is not None:
        memory = log.memory[rank][max(log.memory[rank])]
        figures["peak_allocated_GiB"] = memory.max_allocated * MIB / GIB
        figures["peak_reserved_GiB"] = memory.max_reserved * MIB / GIB
    ours = [(s.peak_allocated_gib, s.peak_reserved_gib) for s in log.steps.values() if s.peak_reserved_gib is not None]
    if ours:  # our log line's peaks per iteration: the run's peak, wherever Megatron's report fell
        figures["peak_allocated_GiB"] = max(figures.get("peak_allocated_GiB", 0), *(a or 0 for a, _ in ours))
        figures["peak_reserved_GiB"] = max(figures.get("peak_reserved_GiB", 0), *(r for _, r in ours))
    print(f"[{name}] {json.dumps({k: v for k, v in figures.items() if k not in ('argv', 'losses')})}", flush=True)
    return figures
