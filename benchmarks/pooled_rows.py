"""What a row of several runs (rounds, ``--rounds``) pools, for the memory-speed curve (memory_speed_curve.py) and
Megatron-LM's loop side by side (side_by_side_rounds.py): one median of every run's counted iterations and each
round's own, the highest peaks, and what the caching allocator's retries cost the row.

Under a tight cap the allocator's retries come in runs: a run that has not retried for a while starts retrying in
every micro-batch's forward and keeps on (each retry synchronizes every stream, so the host waits for the copies
in flight, and hands the cache back, only for the next forward to map it again). A row's total alone hides that; the
counted lines that retried against those that did not show what the retries cost it, each kind's median side by
side."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["highest_peaks", "pooled_medians", "retries_text", "retry_figures", "rounds_text"]

PEAKS = ("peak_allocated_GiB", "peak_reserved_GiB")


def highest_peaks(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The highest of each peak (``PEAKS``) over a row's runs, where any logged it."""
    found = {key: [figures[key] for figures in runs if figures.get(key) is not None] for key in PEAKS}
    return {key: max(peaks) for key, peaks in found.items() if peaks}


def pooled_medians(per_run: list[list[float]]) -> tuple[float | None, list[float | None]]:
    """The median of every run's counted ms/iter together, and each run's own (None where a run counted none)."""
    counted = [ms for values in per_run for ms in values]
    return (statistics.median(counted) if counted else None), [
        statistics.median(values) if values else None for values in per_run
    ]


def rounds_text(row: dict[str, Any], key: str = "ms_per_round") -> str:
    """Each round's own median (``row[key]``), where a row ran in several: `` (rounds 612, 640)``; else nothing."""
    medians = row.get(key)
    return f" (rounds {', '.join(f'{ms:.0f}' for ms in medians if ms is not None)})" if medians else ""


def retry_figures(lines: list[tuple[int | None, float]]) -> dict[str, Any]:
    """From a row's counted lines, each (the allocator's retries since the line before, its ms/iter), of every
    run: the retries in all (``allocator_retries``, only where any line counted them), and, where some lines
    retried and others did not, how many did and each kind's median ms (``retrying_lines``)."""
    counted = [(n, ms) for n, ms in lines if n is not None]
    if not counted:
        return {}
    figures: dict[str, Any] = {"allocator_retries": sum(n for n, _ in counted)}
    retried = [ms for n, ms in counted if n > 0]
    clean = [ms for n, ms in counted if n == 0]
    if retried and clean:
        figures["retrying_lines"] = {
            "lines": len(retried),
            "of": len(counted),
            "ms_retrying": statistics.median(retried),
            "ms_without": statistics.median(clean),
        }
    return figures


def retries_text(row: dict[str, Any]) -> str:
    """`` allocator retries 172 (in 11 of 14 lines: 857 ms against 753 without)``, or what of it the row has."""
    if not row.get("allocator_retries"):
        return ""
    text = f"  allocator retries {row['allocator_retries']}"
    split = row.get("retrying_lines")
    if split:
        text += (f" (in {split['lines']} of {split['of']} lines: {split['ms_retrying']:.0f} ms "
                 f"against {split['ms_without']:.0f} without)")  # fmt: skip
    return text
