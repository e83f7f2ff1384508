"""The matrix's rows run several times in turn (megatron_side_by_side.py ``--rounds``), pooled into one row each.

The machine's pace drifts over a call by more than a row's cost: run one after another, two rows that do the same
work can differ by 10%. Run in turn, each row once per round, every second round in reverse order (``in_turn``),
every row meets the same drift, to first order; each row's counted iterations (``megatron_job.steady``) from all
its rounds make its median, and each round's own median stays beside it, to show the drift."""

from __future__ import annotations

from typing import Any

from benchmarks.host_pace import pooled_pace
from benchmarks.megatron_job import steady
from benchmarks.pooled_rows import highest_peaks, pooled_medians

__all__ = ["in_turn", "pool", "round_name"]


def in_turn(rows: list[Any], round_: int) -> list[Any]:
    """The order of round ``round_``'s runs (from 1): odd rounds as given, even ones in reverse, so that the row
    run last in one round runs first in the next and a pace drifting one way over the call weighs on each alike."""
    return list(rows) if round_ % 2 else list(rows)[::-1]


def round_name(interval: int, row: str, round_: int) -> str:
    """A run's name (its log file): the first round's is the one a run has without rounds."""
    return f"log{interval}-{row}" if round_ == 1 else f"log{interval}-r{round_}-{row}"


def counted(figures: dict[str, Any]) -> list[float]:
    """A run's iterations that its median counts (its median alone where it logged none by iteration)."""
    by_iteration = figures.get("step_ms_by_iteration") or {}
    if not by_iteration:
        return [figures["step_ms"]]
    by_number = {int(i): ms for i, ms in by_iteration.items()}  # keys are numbers, or their text from JSON
    return [by_number[i] for i in steady(sorted(by_number))]


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from its runs, one per round, in order: the first round's figures, with ``step_ms`` the median
    of every round's counted iterations and ``step_ms_per_round`` each round's own, the highest peaks, each
    round's host pace (``host_pace_ms``, a single run's too), and losses only where every round logged the
    same ones (None otherwise: the row then differs from its base, as a row whose losses change between two
    runs of the same flags must). A round that failed is the row's outcome."""
    if len(runs) == 1:
        return runs[0] | pooled_pace(runs)
    failed = next((figures for figures in runs if "error" in figures), None)
    if failed is not None:
        return failed | {"rounds": len(runs)}
    pooled = dict(runs[0])
    pooled["step_ms"], pooled["step_ms_per_round"] = pooled_medians([counted(figures) for figures in runs])
    pooled |= highest_peaks(runs) | pooled_pace(runs)
    if any(figures.get("losses") != runs[0].get("losses") for figures in runs[1:]):
        pooled["losses"] = None
    pooled["rounds"] = len(runs)
    return pooled
