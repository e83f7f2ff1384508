"""Small synthetic torch.profiler chrome traces for the CPU tests of benchmarks/trace_summary.py and the
side-by-side harness: the few event kinds the summary reads, laid out as kineto writes them (times in µs,
device events on a row per stream with ``args.stream``), so figures can be asserted exactly."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

MS = 1000.0  # µs per ms: the tests speak in ms, traces in µs
COMPUTE, D2H_STREAM, H2D_STREAM = 7, 21, 25


def step(number: int, start_ms: float, length_ms: float) -> dict[str, Any]:
    """Megatron's ``ProfilerStep#N`` annotation on the training thread."""
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "pid": 100, "tid": 100,
            "ts": start_ms * MS, "dur": length_ms * MS}  # fmt: skip


def kernel(start_ms: float, length_ms: float, stream: int = COMPUTE, correlation: int | None = None) -> dict[str, Any]:
    """A kernel on ``stream``; with ``correlation``, tied to the launch of that id."""
    args: dict[str, Any] = {"device": 0, "stream": stream}
    if correlation is not None:
        args["correlation"] = correlation
    return {"ph": "X", "cat": "kernel", "name": "ampere_bf16_gemm", "pid": 0, "tid": stream, "ts": start_ms * MS,
            "dur": length_ms * MS, "args": args}  # fmt: skip


def annotation(name: str, start_ms: float, length_ms: float) -> dict[str, Any]:
    """A ``record_function`` range on the training thread."""
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 100, "tid": 100, "ts": start_ms * MS,
            "dur": length_ms * MS}  # fmt: skip


def launch(at_ms: float, correlation: int) -> dict[str, Any]:
    """The training thread's ``cudaLaunchKernel`` of the kernel with the same ``correlation``."""
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 100,
            "ts": at_ms * MS, "dur": 0.005 * MS, "args": {"correlation": correlation}}  # fmt: skip


def frame(name: str, start_ms: float, length_ms: float) -> dict[str, Any]:
    """A Python frame on the training thread, as ``with_stack`` profiling records it."""
    return {"ph": "X", "cat": "python_function", "name": name, "pid": 100, "tid": 100, "ts": start_ms * MS,
            "dur": length_ms * MS}  # fmt: skip


def memcpy(start_ms: float, length_ms: float, direction: str, mib: float = 64, stream: int | None = None) -> dict:
    """A device-to-host (``d2h``) or host-to-device (``h2d``) copy of ``mib`` MiB, as kineto names them."""
    name = "Memcpy DtoH (Device -> Pinned)" if direction == "d2h" else "Memcpy HtoD (Pinned -> Device)"
    stream = stream if stream is not None else (D2H_STREAM if direction == "d2h" else H2D_STREAM)
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "pid": 0, "tid": stream, "ts": start_ms * MS,
            "dur": length_ms * MS, "args": {"device": 0, "stream": stream, "bytes": int(mib * 2**20)}}  # fmt: skip


def busy_kernels(start_ms: float, end_ms: float, share: float, piece_ms: float = 5.0) -> list[dict[str, Any]]:
    """Compute-stream kernels busy ``share`` of every ``piece_ms`` from ``start_ms`` to ``end_ms``."""
    events, t = [], start_ms
    while t < end_ms - 1e-9:
        length = min(piece_ms, end_ms - t)
        if share > 0:
            events.append(kernel(t, length * share))
        t += length
    return events


def write(path: Path, events: list[dict[str, Any]], gz: bool = False) -> Path:
    """The trace as Megatron's trace handler leaves it (``rank-0.json.gz`` is gzipped)."""
    text = json.dumps({"schemaVersion": 1, "traceEvents": events})
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(path, "wt") as handle:
            handle.write(text)
    else:
        path.write_text(text)
    return path
