"""What ``benchmarks/phases.py`` adds to its phases on request: the host's ms in this project's hooks and in
Python's garbage collector (``--allocator``), the host link's time per phase and what the last backward brought
back (``--link``).

The link's time comes from the offloader's own CUDA events, no profiler: each copy of optimizer state records
one as it starts on its side stream (behind what it waits for) and one as it lands, and each wait of the compute
stream for a copy records a pair around it. Per phase of each iteration, a line gives the ms the link carried
state out, the ms it carried state in (the union of the copies' spans, clipped to the phase) and the ms the
compute stream stood waiting; a second line lists, from the last backward to the next first forward, where
each direction stood still for more than ``GAP_MS`` between two of its copies. After each step a third line
(``note_bring_back``) gives the bytes the last backward's hooks brought back and those started back as it ended,
of the bytes that move, and what bounded the hooks: the room the step leaves, what coming back early is worth,
whether the allocator's retries limited them, whether they stopped (a retry, or no room left that they may
fill), whether the backward's growth was learned yet.
"""

from __future__ import annotations

import functools
import itertools
import re
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

from benchmarks.phase_lines import SKIPPED_LINES, Event, Mark
from megatron_offload.core.stats import KINDS  # copies out, copies back, the compute stream waiting: the line's order
from megatron_offload.core.streams import OFFLOAD, PREFETCH

LINK_PREFIX = "link per phase (out/in/waited ms):"
GAPS_PREFIX = "link stood still (phase+ms from its start:ms):"
GAP_MS = 1.0
AFTER_MS = 150.0  # past the step: the next first forward, which the copies out the step leaves run into
BRING_BACK_PREFIX = "last backward brought back (MiB):"
MIB = 1 << 20

Span = tuple[float, float]


def merged(spans: Iterable[Span]) -> list[Span]:
    """The union of spans, as disjoint spans in order."""
    union: list[Span] = []
    for start, end in sorted(spans):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((start, end))
    return union


def covered(union: list[Span], start: float, end: float) -> float:
    """How much of [start, end] the disjoint spans cover."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in union)


def gaps(union: list[Span], start: float, end: float, least: float = GAP_MS) -> list[Span]:
    """The holes longer than ``least`` between consecutive spans that start in [start, end]."""
    inside = [span for span in union if start <= span[0] <= end]
    return [(a[1], b[0]) for a, b in itertools.pairwise(inside) if b[0] - a[1] > least]


class LinkTimeline:
    """The offloader's copy and wait events, and each finished iteration's phase marks; the lines at exit. Every
    event is kept to the end (over a thousand an iteration that moves state): for runs of tens of iterations, as
    benchmarks run."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Event, Event]] = []
        self.iterations: list[list[Mark]] = []

    def install(self) -> None:
        """Keep every timed span the offloader files (``Timings.add``) besides filing it."""
        from megatron_offload.core import stats

        filed = stats.Timings.add
        spans = self.spans

        @functools.wraps(filed)
        def add(timings: Any, kind: str, step: int, start: Any, end: Any) -> None:
            spans.append((kind, start, end))
            filed(timings, kind, step, start, end)

        stats.Timings.add = add

    def iteration(self, marks: list[Mark]) -> None:
        self.iterations.append(marks)

    def lines(self) -> list[str]:
        """Every iteration's link line and gaps line; every event must have completed (at exit, after a sync)."""
        if not self.iterations:
            return []
        origin = self.iterations[0][0][1]
        at = origin.elapsed_time  # ms from iteration 1's start, on the device
        unions = {kind: merged((at(s), at(e)) for k, s, e in self.spans if k == kind) for kind in KINDS}
        said = []
        for marks in self.iterations:
            times = [(phase, at(event)) for phase, event, _, _ in marks]
            parts = [
                f"{phase}=" + "/".join(f"{covered(unions[kind], start, end):.1f}" for kind in KINDS)
                for (_, start), (phase, end) in itertools.pairwise(times)
            ]
            said.append(f"{LINK_PREFIX} " + " ".join(parts))
            holes = {kind: " ".join(self._gaps(times, unions[kind])) for kind in (OFFLOAD, PREFETCH)}
            said.append(f"{GAPS_PREFIX} out {holes[OFFLOAD]} | in {holes[PREFETCH]}")
        return said

    @staticmethod
    def _gaps(times: list[tuple[str, float]], union: list[Span]) -> list[str]:
        """One direction's holes from the last backward's start to ``AFTER_MS`` past the step (the next first
        forward), each as the phase it falls in, ms from that phase's start, and its length."""
        names = [phase for phase, _ in times]
        if "Blast" not in names or names[-1] != "step":
            return []
        begin, end = times[names.index("Blast") - 1][1], times[-1][1] + AFTER_MS
        named = []
        for hole_start, hole_end in gaps(union, begin, end):
            phase, phase_start = _phase_at(times, hole_start)
            named.append(f"{phase}+{hole_start - phase_start:.0f}:{hole_end - hole_start:.1f}")
        return named


def _phase_at(times: list[tuple[str, float]], moment: float) -> tuple[str, float]:
    """The phase that ``moment`` falls in, and its start; past the iteration's end, "after"."""
    for (_, start), (phase, end) in itertools.pairwise(times):
        if start <= moment < end:
            return phase, start
    return "after", times[-1][1]


def link_summary(text: str, skip: int = SKIPPED_LINES) -> dict[str, list[float]]:
    """Per phase, the median out and in ms of a log's link lines after the first ``skip`` (``table``'s shape)."""
    found: dict[str, list[list[float]]] = {}
    for text_line in [line for line in text.splitlines() if line.startswith(LINK_PREFIX)][skip:]:
        for phase, values in re.findall(r"(\w+)=([0-9.]+/[0-9.]+/[0-9.]+)", text_line):
            found.setdefault(phase, []).append([float(v) for v in values.split("/")])
    return {phase: [statistics.median(r[i] for r in rows) for i in (0, 1)] for phase, rows in found.items()}


def time_hooks(host_ms: dict[str, float]) -> None:
    """Add up the host's ms in Python's garbage collector and in this project's training-loop hooks (the
    forward's and the backward's, wrapped before they are registered, and what the gradients' finalize
    starts, looked up at each call) into ``host_ms``."""
    import gc

    from megatron_offload.megatron import backward_prefetch, finalize_prefetch, pacing

    started = [0.0]

    def collecting(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            host_ms["gc"] += (time.perf_counter() - started[0]) * 1e3

    gc.callbacks.append(collecting)

    def timed(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def hook(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                host_ms["hooks"] += (time.perf_counter() - start) * 1e3

        return hook

    pacing.RoomForForward.before_forward = timed(pacing.RoomForForward.before_forward)
    prefetch = backward_prefetch.PrefetchDuringBackward
    prefetch.on_grad_ready = timed(prefetch.on_grad_ready)
    finalize_prefetch.bring_back_for_step = timed(finalize_prefetch.bring_back_for_step)


def note_bring_back(say: Callable[[str], None]) -> None:
    """After each step, before the last backward's pacer starts afresh (``PrefetchDuringBackward.new_iteration``),
    one ``BRING_BACK_PREFIX`` line, where state moves (the module docstring); the bytes started back as the backward
    ended are counted as ``finalize_prefetch.bring_back_for_step`` returns them (looked up at each call)."""
    from megatron_offload.megatron import backward_prefetch, finalize_prefetch

    at_end = [0]
    bring_back = finalize_prefetch.bring_back_for_step

    @functools.wraps(bring_back)
    def counted(handle: Any) -> int:
        at_end[0] = bring_back(handle)
        return at_end[0]

    finalize_prefetch.bring_back_for_step = counted
    fresh = backward_prefetch.PrefetchDuringBackward.new_iteration

    @functools.wraps(fresh)
    def new_iteration(pacer: Any) -> None:
        if pacer.moving:
            bound = pacer.step_bound()
            room = "unknown" if bound is None else f"{(bound + pacer.brought) // MIB}"
            say(
                f"{BRING_BACK_PREFIX} hooks {pacer.brought // MIB}, as it ended {at_end[0] // MIB}, of "
                f"{pacer.moving // MIB} moving; room at the step {room}, worth {pacer.worth // MIB}; "
                f"limited {pacer.limited}, stopped {pacer.stopped}, learned {pacer.ahead is not None}"
            )
        at_end[0] = 0
        fresh(pacer)

    backward_prefetch.PrefetchDuringBackward.new_iteration = new_iteration


def bring_back_summary(text: str, skip: int = SKIPPED_LINES) -> str:
    """A log's ``BRING_BACK_PREFIX`` lines after the first ``skip``: the medians of the hooks' and the end's MiB,
    and in how many iterations the hooks were limited or stopped; empty without such lines."""
    found = [
        re.search(r"hooks (\d+), as it ended (\d+), .* limited (\w+), stopped (\w+)", line)
        for line in text.splitlines()
        if line.startswith(BRING_BACK_PREFIX)
    ][skip:]
    found = [match for match in found if match]
    if not found:
        return ""
    hooks = statistics.median(int(m.group(1)) for m in found)
    end = statistics.median(int(m.group(2)) for m in found)
    limited = sum(m.group(3) == "True" for m in found)
    stopped = sum(m.group(4) == "True" for m in found)
    return (
        f"back during the last backward {hooks:.0f} MiB, as it ended {end:.0f} MiB (medians of {len(found)} "
        f"iterations); limited in {limited}, stopped in {stopped}"
    )
