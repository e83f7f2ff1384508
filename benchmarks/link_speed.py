"""The host link as a benchmark call finds it, and the floor of weight streaming's optimizer step over it.

``measure()`` copies ``nbytes`` between pinned host memory and the GPU: in, out, and both at once on two
streams (what the streamed step does), best of ``reps``. Run as ``python -m benchmarks.link_speed`` it prints
one JSON line; the benchmarks run it in a process of its own before their rows, so that no CUDA context of
theirs holds GPU memory while the rows train.

``step_floor_ms()``: with ``--offload-weights`` the masters and gradients live in host memory and each step
brings them in (4 + 4 bytes per parameter) and writes the masters and bf16 weights back (4 + 2); the optimizer
state that moves (the row's offloaded bytes) crosses both ways. The floor is the slowest of: the bytes in over
the link in, the bytes out over the link out, and all of them over both directions at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

GB = 1e9
GIB = 2**30
IN_PER_PARAM = 8  # fp32 masters and gradients in
OUT_PER_PARAM = 6  # fp32 masters and bf16 weights out

__all__ = ["measure", "measured", "step_floor", "step_floor_ms", "with_step_floors"]


def measure(nbytes: int = 2 * GIB, reps: int = 5) -> dict[str, float]:
    """GB/s in (host to GPU), out (GPU to host) and both at once (in + out bytes over the time)."""
    import torch

    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gpu_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def seconds(copies) -> float:
        best = float("inf")
        for _ in range(reps + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for stream, run in zip(streams, copies, strict=False):
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    run()
            for stream in streams[: len(copies)]:
                torch.cuda.current_stream().wait_stream(stream)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    def copy_in() -> None:
        gpu_in.copy_(host_in, non_blocking=True)

    def copy_out() -> None:
        host_out.copy_(gpu_out, non_blocking=True)

    return {
        "in_GBps": round(nbytes / seconds([copy_in]) / GB, 1),
        "out_GBps": round(nbytes / seconds([copy_out]) / GB, 1),
        "both_GBps": round(2 * nbytes / seconds([copy_in, copy_out]) / GB, 1),
    }


def measured() -> dict[str, Any]:
    """``measure()`` in a process of its own; on failure (no GPU) the reason, in one line."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.link_speed"], capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def step_floor_ms(parameters: int, moved_state_bytes: float, link: dict[str, float]) -> float:
    """The streamed step's floor with weights streamed (module docstring), in ms."""
    inward = IN_PER_PARAM * parameters + moved_state_bytes
    outward = OUT_PER_PARAM * parameters + moved_state_bytes
    return 1e3 * max(
        inward / (link["in_GBps"] * GB),
        outward / (link["out_GBps"] * GB),
        (inward + outward) / (link["both_GBps"] * GB),
    )


def step_floor(figures: dict[str, Any], link: dict[str, Any]) -> None:
    """Adds to a weight-streaming row its optimizer step (iteration less forward-backward), that step's floor
    and their ratio, where the row and the link have the figures."""
    needed = ("step_ms", "forward_backward_ms", "parameters")
    if "error" in link or any(figures.get(key) is None for key in needed):
        return
    moved = (figures.get("offloaded_GiB") or 0.0) * GIB
    floor = step_floor_ms(int(figures["parameters"]), moved, link)
    step = figures["step_ms"] - figures["forward_backward_ms"]
    figures |= {"optimizer_step_ms": round(step, 1), "optimizer_step_floor_ms": round(floor, 1)}
    figures["optimizer_step_over_floor"] = round(step / floor, 3)


def with_step_floors(results: dict[str, dict[str, Any]], link: dict[str, Any]) -> None:
    """Every row that streamed weights gets the link as measured in this call and its step beside the floor."""
    for figures in results.values():
        if "--offload-weights" in figures.get("argv", ()):
            figures["host_link_measured"] = link
            step_floor(figures, link)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("link_speed: no CUDA GPU here: the host link is measured on the GPU machine", file=sys.stderr)
        return 2
    print(json.dumps(measure()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
