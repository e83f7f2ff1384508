"""The nightly comparison's two plots, and the allocated-bytes timeline read from PyTorch memory snapshots.

matplotlib is imported only when a plot is drawn, with the Agg backend (no display on CI machines), so
the rest of the report works where it is not installed.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

GIB = 1024**3
COLORS = {
    "baseline": "tab:gray",
    "step": "tab:blue",
    "capped-default": "tab:green",
    "baseline-again": "silver",
    "cpu-offload": "tab:orange",
}


def load_snapshot(path: Path) -> dict[str, Any]:
    """A ``torch.cuda.memory._snapshot()`` pickle; unpickling runs code, so only read files our runs wrote."""
    with open(path, "rb") as file:
        snapshot = pickle.load(file)
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError(f"{path}: not a torch.cuda memory snapshot (no 'segments')")
    return snapshot


def allocated_timeline(snapshot: dict[str, Any], window_ms: float) -> tuple[list[float], list[float]]:
    """Allocated bytes over the trace's last ``window_ms``; x in ms from the window start.

    The snapshot holds the blocks live when it was taken plus the allocator's trace up to then, so the
    end value is the sum of ``active_allocated`` blocks and walking the trace backwards undoes each
    event. As in ``torch.cuda.memory_allocated`` (which Megatron's memory line prints), a block counts
    from ``alloc`` to ``free_requested``: one freed while a side stream still reads it (our copy out)
    is no longer allocated, only not yet reusable until ``free_completed``. Trace sizes are the
    requested sizes, block sizes are rounded up, so the curve can sit a few KiB off the log's figure.
    """
    traces = snapshot.get("device_traces") or []
    device = max(range(len(traces)), key=lambda index: len(traces[index]), default=None)
    if device is None or not traces[device]:
        raise ValueError("the snapshot has no allocator trace (was --record-memory-history given?)")
    trace = [event for event in traces[device] if "time_us" in event]
    blocks = [
        block
        for segment in snapshot["segments"]
        if segment.get("device", device) == device
        for block in segment.get("blocks", [])
    ]
    allocated = sum(block["size"] for block in blocks if block.get("state") == "active_allocated")
    start_us = trace[-1]["time_us"] - window_ms * 1000
    points = []  # (time, allocated after the event), newest first
    for event in reversed(trace):
        if event["time_us"] < start_us:
            break
        points.append((event["time_us"], allocated))
        if event["action"] == "alloc":
            allocated -= event["size"]
        elif event["action"] == "free_requested":
            allocated += event["size"]
    points.append((start_us, allocated))
    points.reverse()
    return [(time - start_us) / 1000 for time, _ in points], [float(value) for _, value in points]


def timelines(
    snapshots: dict[str, Path], windows: dict[str, float | None], notes: list[str]
) -> dict[str, tuple[list[float], list[float]]]:
    """Each run's last ``windows[name]`` ms from its snapshot; a missing or unreadable one becomes a note."""
    result = {}
    for name, path in snapshots.items():
        window = windows[name]
        if not path.is_file():
            notes.append(f"memory_timeline.png leaves out {name}: no {path.name}")
            continue
        try:
            result[name] = allocated_timeline(load_snapshot(path), window or 0.0)
        except (OSError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as error:
            notes.append(f"memory_timeline.png leaves out {name}: no usable snapshot ({error})")
    return result


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_peak_memory(summaries: dict[str, dict[str, Any]], path: Path, cap_gib: float | None = None) -> None:
    """Grouped bars per run that ran through: peak allocated and peak reserved, in GiB; the cap as a line."""
    plt = _pyplot()
    runs = {name: s for name, s in summaries.items() if s["status"] == "ok" and s["peak_gib"] is not None}
    figure, axes = plt.subplots(figsize=(7, 4.5))
    width = 0.38
    for offset, key, label in [
        (-width / 2, "peak_gib", "peak allocated"),
        (width / 2, "max_reserved_gib", "peak reserved"),
    ]:
        values = [s[key] or 0.0 for s in runs.values()]
        bars = axes.bar([i + offset for i in range(len(runs))], values, width, label=label)
        axes.bar_label(bars, fmt="%.2f", fontsize=8)
    if cap_gib is not None:
        axes.axhline(cap_gib, color="tab:red", linestyle="--", label=f"cap of the capped rows ({cap_gib:.2f} GiB)")
    axes.set_xticks(range(len(runs)), list(runs))
    axes.set_ylabel("GiB per rank")
    axes.set_title("GPU memory at the peak, per run")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_timeline(timelines: dict[str, tuple[list[float], list[float]]], path: Path) -> None:
    """Allocated GiB over each run's last iteration, all runs on one chart."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(9, 4.5))
    for name, (xs, ys) in timelines.items():
        axes.step(xs, [y / GIB for y in ys], where="post", label=name, color=COLORS.get(name))
    axes.set_xlabel("ms from the window start (the last median step time of each run)")
    axes.set_ylabel("allocated GiB")
    axes.set_title("GPU memory allocated over the last iteration")
    axes.set_ylim(bottom=0)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
