"""Each nightly run's summary from its parsed log (memory_report.py): medians after the warm-up, peaks at the
last iteration, and whether it ran through; and reading a folder's logs into summaries, with what a run that
must not fit or is only a reference may say instead. Pure Python, like memory_report.py.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.host_pace import logged_span, pace_over, read_samples
from benchmarks.memory_report import GIB, MIB, RunLog, last_error_line, parse_log

WARMUP_ITERATIONS = 2  # start-up allocations and kernel autotuning land in the first iterations
_OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory|out of GPU memory")


def _median(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _quartiles(values: list[float | None]) -> tuple[float, float] | None:
    """First and third quartiles: how far single iterations spread around the median the checks judge."""
    present = [value for value in values if value is not None]
    if len(present) < 2:
        return None
    first, _, third = statistics.quantiles(present, n=4)
    return first, third


@dataclass
class RunSummary:
    """The figures of one run that the table, the plots and the checks use."""

    status: str  # "ok", "failed", "not available" or (a run that must not fit) "out of memory"
    detail: str = ""
    iterations: int = 0
    median_step_ms: float | None = None
    quartile_step_ms: tuple[float, float] | None = None  # the steady iterations' first and third quartiles
    allocated_gib: float | None = None  # median "allocated" between steps, after the warm-up
    peak_gib: float | None = None  # "max allocated" at the last iteration
    max_reserved_gib: float | None = None  # "max reserved" at the last iteration
    offloaded_gib: float | None = None
    exposed_ms: float | None = None
    copy_out_ms: float | None = None
    copy_in_ms: float | None = None
    final_loss: float | None = None
    memory_rank: int | None = None
    host_pace_ms: float | None = None  # the host's pace over the steady iterations (host_pace.py), where sampled
    host_slow_share: float | None = None


def _steady(iterations: list[int]) -> list[int]:
    later = [i for i in sorted(iterations) if i > WARMUP_ITERATIONS]
    return later or sorted(iterations)


def pooled_step_ms(logs: list[RunLog]) -> tuple[float | None, tuple[float, float] | None]:
    """The median and quartiles of the step times over the steady iterations of several runs together."""
    times: list[float | None] = [log.steps[i].step_ms for log in logs for i in _steady(list(log.steps))]
    return _median(times), _quartiles(times)


def summarize(log: RunLog) -> RunSummary:
    """Medians after the warm-up, peaks at the last iteration; "failed" when the run did not finish."""
    if not log.steps:
        return RunSummary("failed", log.error or "no iteration lines in the log")
    last = max(log.steps)
    if log.error or (log.train_iters is not None and last < log.train_iters):
        return RunSummary("failed", log.error or f"stopped at iteration {last} of {log.train_iters}")
    steps = [log.steps[i] for i in _steady(list(log.steps))]
    summary = RunSummary(
        "ok",
        iterations=len(log.steps),
        median_step_ms=_median([s.step_ms for s in steps]),
        quartile_step_ms=_quartiles([s.step_ms for s in steps]),
        offloaded_gib=log.steps[last].offloaded_gib,
        exposed_ms=_median([s.exposed_ms for s in steps]),
        copy_out_ms=_median([s.copy_out_ms for s in steps]),
        copy_in_ms=_median([s.copy_in_ms for s in steps]),
        final_loss=log.steps[last].loss,
        memory_rank=log.memory_rank,
    )
    if log.memory_rank is not None:
        memory = log.memory[log.memory_rank]
        summary.allocated_gib = _median([memory[i].allocated * MIB / GIB for i in _steady(list(memory))])
        summary.peak_gib = memory[max(memory)].max_allocated * MIB / GIB
        summary.max_reserved_gib = memory[max(memory)].max_reserved * MIB / GIB
    return summary


def read_runs(
    source: Path, names: list[str], runs_info: dict[str, Any], required: tuple[str, ...], must_not_fit: tuple[str, ...]
) -> tuple[dict[str, RunLog], dict[str, RunSummary]]:
    """Parse and summarize ``source/<name>.log`` of each run.

    ``runs_info`` holds each run's recorded ``returncode`` (run_info.json). A run that ran through gets the
    host's pace over its steady iterations where ``source/host-pace.txt`` holds samples of them. A run in
    ``must_not_fit`` is expected to stop: "out of memory" when its log says so, "failed" for any other stop,
    "ok" if it ran through. Another run that is not ``required`` and did not finish is "not available"; one
    with neither a log nor a record was skipped and is left out.
    """
    logs: dict[str, RunLog] = {}
    summaries: dict[str, RunSummary] = {}
    samples = read_samples(source / "host-pace.txt")  # sampled beside the runs (memory_runs.run_rows)
    for name in names:
        path = source / f"{name}.log"
        if not path.is_file() and name not in required + must_not_fit and name not in runs_info:
            continue
        text = path.read_text(errors="replace") if path.is_file() else ""
        logs[name] = parse_log(text)
        if not path.is_file():
            logs[name].error = f"no log {path.name}"
        elif runs_info.get(name, {}).get("returncode", 0) != 0:
            logs[name].error = f"exit {runs_info[name]['returncode']}: {last_error_line(text)}"
        summaries[name] = summary = summarize(logs[name])
        if summary.status == "ok":
            span = logged_span(text, _steady)
            if pace := span and pace_over(samples, *span):
                summary.host_pace_ms, summary.host_slow_share = pace["median_ms"], pace["slow_share"]
            continue
        if name in must_not_fit:
            summary.status = "out of memory" if _OUT_OF_MEMORY.search(text) else "failed"
            said = [line for line in text.splitlines() if line.startswith("megatron-offload: out of GPU memory")]
            detail = said[-1] if said else last_error_line(text)  # the launcher's one line, where it printed one
            summary.detail = detail.split(". ")[0] if path.is_file() else summary.detail
        elif name not in required:
            summary.status = "not available"
            summary.detail = logs[name].error or last_error_line(text)
    return logs, summaries
