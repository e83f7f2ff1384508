"""The lines benchmarks/phases.py prints, and reading them back: each iteration's GPU and host milliseconds per
phase, the allocator's and the host's counters per phase, their medians or means over a log, and a table of
runs side by side (the sweep's text uses it too); and the one host reading of an allocator line that is not a
clock call (the main thread's runqueue time, the machine's stolen time, its kernel time and page faults)."""

from __future__ import annotations

import itertools
import os
import re
import resource
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from benchmarks.memory_report import parse_log

PREFIX = "phases (GPU/host ms):"
ALLOCATOR_LINE = "allocator and host per phase"  # then its fields (COUNTED) in parentheses
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")
# The fields of an allocator line. The main thread's CPU time beside its host ms tells a busy thread from one that
# waited; its runqueue time, a wait for a core from a wait for the GIL or the driver; the other threads' CPU time
# whether any of them ran then; the time the hypervisor ran other guests on this machine's cores (all of them
# together), whether the host was slow because it was not ours; of the main thread's CPU time, the kernel's share, its
# page faults and the times the kernel took its core away: whether a slow phase ran Python or waited in the kernel.
COUNTED = (
    "retries", "maps", "unmaps", "gc ms", "hooks ms", "main thread cpu ms", "other threads cpu ms",
    "main thread runqueue ms", "stolen ms", "main thread kernel ms", "main thread page faults",
    "main thread involuntary switches",
)  # fmt: skip
ALLOCATOR_PREFIX = f"{ALLOCATOR_LINE} ({'/'.join(COUNTED)}):"
SKIPPED_LINES = 3  # the first iterations: the offloader learns, Megatron compiles


class Event(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, other: Any) -> float: ...


Mark = tuple[str, Event, float, tuple[float, ...]]  # (phase ending here, event, host time, counters)


def line(marks: list[Mark]) -> str:
    parts = [
        f"{phase}={start.elapsed_time(end):.1f}/{(end_host - start_host) * 1e3:.1f}"
        for (_, start, start_host, _), (phase, end, end_host, _) in itertools.pairwise(marks)
    ]
    return f"{PREFIX} " + " ".join(parts)


def counter_line(marks: list[Mark]) -> str:
    """Per phase, how much each counter (COUNTED) grew in it (read on the host as the phase was queued)."""
    parts = [
        f"{phase}=" + "/".join(f"{b - a:g}" for a, b in zip(before, after, strict=True))
        for (_, _, _, before), (phase, _, _, after) in itertools.pairwise(marks)
    ]
    return f"{ALLOCATOR_PREFIX} " + " ".join(parts)


def summary(text: str, skip: int = SKIPPED_LINES) -> dict[str, list[float]]:
    """Per phase, the median GPU and host ms of a log's lines after the first ``skip``."""
    lines = [line for line in text.splitlines() if line.startswith(PREFIX)][skip:]
    gpu: dict[str, list[float]] = {}
    host: dict[str, list[float]] = {}
    for text_line in lines:
        for phase, on_gpu, on_host in re.findall(r"(\w+)=([0-9.]+)/([0-9.]+)", text_line):
            gpu.setdefault(phase, []).append(float(on_gpu))
            host.setdefault(phase, []).append(float(on_host))
    return {phase: [statistics.median(gpu[phase]), statistics.median(host[phase])] for phase in gpu}


def outside_lines(texts: dict[str, str], rows: dict[str, dict[str, list[float]]], skip: int = SKIPPED_LINES) -> str:
    """Per log, Megatron-LM's ms an iteration (the median of its lines past iteration ``skip``) beside the phases'
    sum of medians: the difference is what the loop spends outside ``train_step``, its logging and its timers, which
    synchronize the whole device (``torch.cuda.synchronize()``) and so wait for every copy in flight on any stream."""
    lines = []
    for name, text in texts.items():
        steps = parse_log(text).steps  # Megatron-LM's log lines (at --log-interval k, each the mean of k iterations)
        logged = [step.step_ms for iteration, step in steps.items() if iteration > skip and step.step_ms is not None]
        if logged and rows.get(name):
            median, phases = statistics.median(logged), sum(gpu for gpu, _ in rows[name].values())
            lines.append(
                f"{name[:24]:24} logged {median:.1f} ms an iteration, {median - phases:+.1f} outside train_step\n"
            )
    return "".join(lines)


def order(phase: str) -> tuple[int, int]:
    """Phases in the order they run: pre, x, F1, B1, F2, ..., Blast, step."""
    if phase in ("pre", "x"):
        return (0, ("pre", "x").index(phase))
    if re.fullmatch(r"[FB]\d+", phase):
        return (1, 2 * int(phase[1:]) + (phase[0] == "B"))
    return (2, ("Blast", "step").index(phase) if phase in ("Blast", "step") else 2)


def table(rows: dict[str, dict[str, list[float]]], base: str | None = None) -> str:
    """GPU ms (host ms) per phase and row; with ``base``, each GPU figure's difference to the base row's."""
    phases = sorted({phase for row in rows.values() for phase in row}, key=order)
    lines = [f"{'':24}" + "".join(f"{phase:>14}" for phase in phases) + f"{'sum':>9}"]
    for name, row in rows.items():
        cells = []
        for phase in phases:
            if phase not in row:
                cells.append(f"{'-':>14}")
            elif base and base in rows and name != base and phase in rows[base]:
                cells.append(f"{row[phase][0] - rows[base][phase][0]:+8.1f}({row[phase][1]:4.0f})")
            else:
                cells.append(f"{row[phase][0]:8.1f}({row[phase][1]:4.0f})")
        total = sum(row[phase][0] for phase in phases if phase in row)
        lines.append(f"{name[:24]:24}" + "".join(cells) + f"{total:9.1f}")
    return "\n".join(lines) + "\n"


def counter_summary(
    text: str,
    fields: tuple[str, str] = ("retries", "maps"),
    skip: int = SKIPPED_LINES,
    average: Callable[[list[float]], float] = statistics.mean,
) -> dict[str, list[float]]:
    """Per phase, the ``average`` (mean; median for host times a few slow phases would skew) of two ``fields``
    (of COUNTED) over a log's allocator lines after the first ``skip``: the same shape as ``summary``'s, so that
    ``table`` prints them. Lines of five fields (written before the CPU times were counted) are read too, for their
    fields."""
    counts: dict[str, list[list[float]]] = {}
    # By ALLOCATOR_LINE: the fields in parentheses vary with the log's age.
    for text_line in [line for line in text.splitlines() if line.startswith(ALLOCATOR_LINE)][skip:]:
        for phase, values in re.findall(r"(\w+)=([0-9.e+-]+(?:/[0-9.e+-]+){4,})", text_line):
            counts.setdefault(phase, []).append([float(value) for value in values.split("/")])
    picked = [COUNTED.index(field) for field in fields]
    return {phase: [average([c[i] for c in rows]) for i in picked] for phase, rows in counts.items()}


def runqueue_ms(schedstat: Path = Path("/proc/thread-self/schedstat")) -> float:
    """Milliseconds the calling thread has stood runnable without a CPU (Linux schedstat's second field, in ns),
    0 where the kernel keeps none."""
    try:
        return int(schedstat.read_text().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


def stolen_ms(stat: Path = Path("/proc/stat")) -> float:
    """Milliseconds of CPU time the hypervisor gave other guests, all of this machine's cores together since boot
    (``/proc/stat``'s first line, its eighth value, in clock ticks), 0 where the kernel reports none."""
    try:
        ticks = int(stat.read_text().split("\n", 1)[0].split()[8])
    except (OSError, IndexError, ValueError):
        return 0.0
    return ticks * 1e3 / os.sysconf("SC_CLK_TCK")


def thread_usage() -> tuple[float, int, int]:
    """The calling thread's kernel CPU ms, page faults (minor and major) and involuntary context switches since it
    began (``getrusage(RUSAGE_THREAD)``, Linux); zeros where the kernel has no per-thread usage."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return 0.0, 0, 0
    usage = resource.getrusage(who)
    return usage.ru_stime * 1e3, usage.ru_minflt + usage.ru_majflt, usage.ru_nivcsw
