"""Stand-ins for the memory-speed sweep's torchrun jobs (benchmarks/megatron_side_by_side.py --sweep), for its
tests without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import megatron_job as job
from benchmarks import megatron_side_by_side as side
from benchmarks import memory_speed_curve as curve

__all__ = ["GIB", "OUR_RUN_S", "PARAMETERS", "STATE_GIB", "run_sweep", "sweep_run"]

GIB = 1024**3
PARAMETERS = 955_000_000  # configs/gpt_0p9b.yaml: 12 bytes each, 10.67 GiB of state
STATE_GIB = 12 * PARAMETERS / GIB
# The estimate's wall time of one of our runs at 4 micro-batches: start-up, 2 s, each iteration's micro-batches,
# step and offloading's extra (memory_speed_curve.estimate_s's model)
OUR_RUN_S = curve.STARTUP_S["ours"] + 2 + curve.SWEEP_ITERS * (0.15 * 4 + 0.05 + 0.3)


def sweep_run(fits: float = 16.5, fraction_ms: float = 700.0, copy_out_ms: dict[str, float] | None = None):
    """Stand-in for a job: no offload peaks at 26.4 GiB reserved; an offload run that needs more than
    ``fits`` GiB under its cap runs out of memory; a capped no-offload run always does. ``copy_out_ms``: the
    copy-out time our run under each cap (by its flag's value) logs for 5 GiB moved (none: it logs none)."""

    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        flag = "--offload-gpu-memory-cap-gib"
        cap = float(argv[argv.index(flag) + 1]) if flag in argv else None
        offload = "--offload-optimizer-states" in argv or "--chunked-optimizer-state-offload" in argv
        if cap is not None and (not offload or cap < fits):
            return {"argv": argv, "error": "torch.OutOfMemoryError: CUDA out of memory.", "did_not_fit": True}
        ms = 600.0 if not offload else (800.0 if "--chunked-optimizer-state-offload" in argv else fraction_ms)
        return {
            "argv": argv, "returncode": 0, "losses": {i: 10.0 - i for i in range(1, 13)},
            "step_ms_by_iteration": {1: 3000.0, 2: 1500.0, **dict.fromkeys(range(3, 13), ms)},
            "peak_allocated_GiB": 26.2 if not offload else 15.6, "peak_reserved_GiB": 26.4 if not offload else 16.2,
            "parameters": PARAMETERS, "megatron_args": {"micro_batch_size": "2", "global_batch_size": "8",
                                                        "data_parallel_size": "1"},
        } | ({"offloaded_GiB": 5.0, "copy_out_in_ms": [copy_out_ms[argv[argv.index(flag) + 1]], 99.0]}
             if copy_out_ms and cap is not None and offload else {})  # fmt: skip

    return run


def run_sweep(monkeypatch: pytest.MonkeyPatch, argv: list[str], run) -> tuple[int, list[tuple[str, list[str]]]]:
    calls: list[tuple[str, list[str]]] = []

    def recording(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        calls.append((name, argv))
        return run(name, argv, gpus, out, env_extra)

    monkeypatch.setattr(job, "run", recording)
    monkeypatch.setattr(side, "preflight", lambda argv: None)
    monkeypatch.setattr(sys, "argv", ["megatron_side_by_side.py", "--sweep", *argv])
    return side.main(), calls
