"""The host CPU's pace over a benchmark call, and each run's share of it.

A process of its own beside the runs (``PaceLog``) times a fixed pure-Python loop once a second (the best of
three: ``spin_ms``) and writes the wall-clock time and the loop's milliseconds, a line each. On the lent H200s
the loop's time flips between two levels about 1.8x apart every few seconds, with the GPU idle as much as
under training; Megatron-LM's forwards are bound by the host there, so a row's ms/iter moves with the host's
pace as much as with what it offloads. Each run gets ``host_pace``: over the iterations its ms/iter counts (the
times Megatron stamps on their log lines), the median of the loop's samples and the share of them slower than
``SLOW`` times the call's fast level (the 10th percentile of all samples so far). The share says how the machine
ran beside a row, not how fast its training thread ran: within a run, the iterations the sampler labels fast
ran no faster than those it labels slow, while the same forward's CPU time in the training thread moves by
about a third from one run to the next.

    python -m benchmarks.host_pace FILE   # the sampler alone, until stopped
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["PaceLog", "iteration_times", "logged_span", "pace_over", "pace_text", "pooled_pace", "spin_ms"]

SPIN_ITERATIONS = 20_000  # about 1 ms of pure Python on the lent hosts' fast level
SLOW = 1.3  # a sample this many times the fast level counts as slow (the levels lie about 1.8x apart)
PERIOD_S = 1.0
_LINE = re.compile(r"^\s*\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\] iteration\s+(\d+)/", re.MULTILINE)


def spin_ms() -> float:
    """The best of three timings of a fixed pure-Python loop, in ms: the host's pace for one thread now."""
    best = float("inf")
    for _ in range(3):
        started, total = time.perf_counter(), 0
        for i in range(SPIN_ITERATIONS):
            total += i * i
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def sample(path: Path, period_s: float = PERIOD_S) -> None:
    """Append ``<unix time> <spin ms>`` to ``path`` every ``period_s`` until the process is stopped."""
    with path.open("a", buffering=1) as out:
        while True:
            out.write(f"{time.time():.3f} {spin_ms():.4f}\n")
            time.sleep(period_s)


def read_samples(path: Path) -> list[tuple[float, float]]:
    """The (unix time, spin ms) lines written so far; a line cut short by a write under way is left out."""
    samples = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 2:
            try:
                samples.append((float(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return samples


def pace_over(samples: list[tuple[float, float]], start: float, end: float) -> dict[str, Any] | None:
    """The samples between ``start`` and ``end``: their median ms, the share slower than ``SLOW`` times the fast
    level of all ``samples`` (their 10th percentile), their count; None where none fell in the span."""
    inside = [ms for at, ms in samples if start <= at <= end]
    if not inside:
        return None
    everything = sorted(ms for _, ms in samples)
    fast = everything[len(everything) // 10]
    slow = sum(ms > SLOW * fast for ms in inside) / len(inside)
    return {"median_ms": statistics.median(inside), "slow_share": slow, "samples": len(inside), "fast_ms": fast}


def iteration_times(text: str) -> dict[int, float]:
    """Megatron's stamp on each ``iteration N/M`` log line (the host's local time) as unix time, by iteration."""
    return {int(n): datetime.strptime(at, "%Y-%m-%d %H:%M:%S.%f" if "." in at else "%Y-%m-%d %H:%M:%S").timestamp()
            for at, n in _LINE.findall(text)}  # fmt: skip


def counted_span(stamps: dict[int, float], counted: list[int]) -> tuple[float, float] | None:
    """From the line before the first counted iteration (they ran after it) to the last counted line."""
    if not counted or any(i not in stamps for i in counted):
        return None
    earlier = [i for i in stamps if i < counted[0]]
    return stamps[max(earlier)] if earlier else stamps[counted[0]], stamps[counted[-1]]


def logged_span(text: str, counted: Callable[[list[int]], list[int]]) -> tuple[float, float] | None:
    """``counted_span`` of a Megatron log: ``counted`` picks, from its logged iterations, those a figure counts."""
    stamps = iteration_times(text)
    return counted_span(stamps, counted(sorted(stamps)))


class PaceLog:
    """The sampler as a child process for the life of a ``with`` block; ``timed(run)`` wraps a job runner so
    that each run's figures get ``host_pace`` over the span in its ``counted_span`` (unix times)."""

    def __init__(self, path: Path) -> None:
        self.path, self.process = path, None

    def __enter__(self) -> PaceLog:
        self.path.unlink(missing_ok=True)
        self.process = subprocess.Popen([sys.executable, "-m", "benchmarks.host_pace", str(self.path)],
                                        cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()  # a sampler between two samples stops at once
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # never leave it running past the benchmark
                self.process.kill()
                self.process.wait()
            self.process = None

    def timed(self, run: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        def timed_run(*args: Any, **kwargs: Any) -> dict[str, Any]:
            figures = run(*args, **kwargs)
            span = figures.get("counted_span")
            pace = pace_over(read_samples(self.path), *span) if span else None
            return figures | {"host_pace": pace} if pace else figures

        return timed_run


def pooled_pace(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's host pace over its runs (each round's): ``host_pace_ms`` and ``host_slow_share``, a value per run
    that has one; nothing where none has."""
    paces = [figures["host_pace"] for figures in runs if figures.get("host_pace")]
    if not paces:
        return {}
    return {"host_pace_ms": [p["median_ms"] for p in paces], "host_slow_share": [p["slow_share"] for p in paces]}


def pace_text(row: dict[str, Any]) -> str:
    """``  host 0.95 ms, 12% slow`` (each run's, where several): the row's pace (``pooled_pace``) beside its
    ms/iter."""
    if not row.get("host_pace_ms"):
        return ""
    runs = zip(row["host_pace_ms"], row["host_slow_share"], strict=True)
    return "  host " + " / ".join(f"{ms:.2f} ms, {share:.0%} slow" for ms, share in runs)


if __name__ == "__main__":
    sample(Path(sys.argv[1]))
