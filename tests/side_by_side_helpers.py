"""Stand-ins for benchmarks/megatron_side_by_side.py's torchrun jobs, for its tests without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import megatron_job as job
from benchmarks import megatron_side_by_side as side
from tests.chrome_traces import busy_kernels, memcpy, step, write

__all__ = ["fake_run", "run_main"]


def fake_run(failing: set[str], step_ms: dict[str, float] | None = None, losses: dict[str, dict] | None = None):
    """Stand-in for one torchrun job: figures for a run that worked, an error for the named ones. A
    profiled job leaves a trace where Megatron would (TENSORBOARD_DIR/../torch_profile/rank-0.json.gz):
    the compute stream busy 80% without offloading, 40% where the copies run with it."""

    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict[str, object]:
        if name in failing:
            return {"argv": argv, "returncode": 1, "error": "AssertionError: Megatron requires CUDA."}
        if "--tensorboard-dir" in argv:
            folder = Path(argv[argv.index("--tensorboard-dir") + 1]).parent / "torch_profile"
            offload = "--offload-optimizer-states" in argv or "--chunked-optimizer-state-offload" in argv
            events = [step(7, 0, 100), *busy_kernels(0, 100, 0.8)]
            if offload:
                events = [step(7, 0, 100), *busy_kernels(0, 25, 0.8), *busy_kernels(25, 50, 0.4)]
                events += [*busy_kernels(50, 100, 0.8), memcpy(25, 25, "d2h")]
            write(folder / "rank-0.json.gz", events, gz=True)
        return {"argv": argv, "returncode": 0, "losses": (losses or {}).get(name, {5: 1.0}),
                "step_ms": (step_ms or {}).get(name, 10.0), "peak_allocated_GiB": 4.0, "offloaded_GiB": 1.0,
                "exposed_ms": 0.0}  # fmt: skip

    return run


def run_main(monkeypatch: pytest.MonkeyPatch, argv: list[str], run) -> tuple[int, list[tuple]]:
    """main() with ``run`` standing in for torchrun; the calls it made, as (name, argv, env_extra)."""
    calls: list[tuple] = []

    def recording(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        calls.append((name, argv, env_extra))
        return run(name, argv, gpus, out, env_extra)

    monkeypatch.setattr(job, "run", recording)
    monkeypatch.setattr(sys, "argv", ["megatron_side_by_side.py", *argv])
    return side.main(), calls
