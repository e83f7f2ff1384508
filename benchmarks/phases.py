"""Where each iteration's time goes in Megatron-LM's loop, without a profiler.

torch.profiler slows the host by about half, and in this loop the host's pace decides the forward's (a
forward's kernels take about 35 ms on an H100 for configs/gpt_0p9b.yaml, launching them about 50), so a
profiled iteration answers for another program. Here a CUDA event goes on the compute stream at a few
points of each iteration instead:
- ``train_step`` starting and returning;
- the forward-backward function starting and returning;
- each micro-batch's forward starting and returning (the GPT model's ``forward``).
The gaps between them are the phases: ``pre`` (train_step before forward-backward), ``x`` (forward-backward
up to the first forward), ``F1`` (micro-batch 1's forward), ``B1`` (its backward, and the next micro-batch's
data), ... ``Blast`` (the last backward, and the gradients' finalize), ``step`` (the rest of train_step: the
optimizer step). Each is given in GPU milliseconds (between the events) and host milliseconds (between
the calls that queued them). An iteration's line is printed on global rank 0 once its last event has
completed, read without waiting; the rest at exit.

    python -m benchmarks.phases SCRIPT [ARGS...]     runs SCRIPT as ``python -m megatron_offload.run`` does
    python -m benchmarks.phases --snapshot-forwards N PATH SCRIPT [ARGS...]
                                                     also the allocator's snapshot at the end of each forward
                                                     of iteration N (the activations' peaks), to PATH-F1.pickle,
                                                     PATH-F2.pickle, ... (benchmarks/snapshot_layout.py reads them)
    python -m benchmarks.phases --summary LOG ...    each log's medians per phase (iterations 4 on)

Only ``forward_backward_no_pipelining`` is marked: with pipeline parallelism ``pre`` and ``Blast`` are missing.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import pickle
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

PREFIX = "phases (GPU/host ms):"
SKIPPED_LINES = 3  # the first iterations: the offloader learns, Megatron compiles


class Event(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, other: Any) -> float: ...


class Marks:
    """Events of the iterations under way; one line for each once it has completed."""

    def __init__(
        self,
        event: Callable[[], Event],
        say: Callable[[str], None],
        after_forward: Callable[[int, int], None] | None = None,
    ) -> None:
        self.event = event
        self.say = say
        self.after_forward = after_forward  # called with (iteration, forward) as each forward ends
        self.iterations = 0
        self.current: list[tuple[str, Event, float]] = []  # (phase ending here, event, host time)
        self.done: list[list[tuple[str, Event, float]]] = []  # whole iterations, events maybe still running
        self.forwards = 0

    def mark(self, phase: str) -> None:
        event = self.event()
        event.record()
        self.current.append((phase, event, time.perf_counter()))

    def iteration_starts(self) -> None:
        if self.current:
            self.done.append(self.current)
        self.current, self.forwards = [], 0
        self.iterations += 1
        self.mark("start")
        self.flush(wait=False)

    def forward_starts(self) -> None:
        self.forwards += 1  # counted from iteration_starts
        self.mark(f"B{self.forwards - 1}" if self.forwards > 1 else "x")

    def forward_ends(self) -> None:
        self.mark(f"F{self.forwards}")
        if self.after_forward is not None:
            self.after_forward(self.iterations, self.forwards)

    def flush(self, wait: bool) -> None:
        """Say each finished iteration whose last event has completed (``wait``: all of them)."""
        while self.done and (wait or self.done[0][-1][1].query()):
            marks = self.done.pop(0)
            marks[-1][1].synchronize()  # completed already, or at exit
            self.say(line(marks))

    def at_exit(self) -> None:
        if self.current and self.current[-1][0] == "step":
            self.done.append(self.current)
            self.current = []
        self.flush(wait=True)


def line(marks: list[tuple[str, Event, float]]) -> str:
    parts = [
        f"{phase}={start.elapsed_time(end):.1f}/{(end_host - start_host) * 1e3:.1f}"
        for (_, start, start_host), (phase, end, end_host) in itertools.pairwise(marks)
    ]
    return f"{PREFIX} " + " ".join(parts)


def around(function: Callable[..., Any], before: Callable[[], None], after: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(function)
    def marked(*args: Any, **kwargs: Any) -> Any:
        before()
        try:
            return function(*args, **kwargs)
        finally:
            after()

    return marked


def install(marks: Marks, training: Any, schedules: Any, gpt_model_class: Any) -> None:
    """Mark Megatron's ``training.train_step``, ``schedules.forward_backward_no_pipelining`` (both looked
    up by name at each call) and ``gpt_model_class.forward``."""
    training.train_step = around(training.train_step, marks.iteration_starts, lambda: marks.mark("step"))
    schedules.forward_backward_no_pipelining = around(
        schedules.forward_backward_no_pipelining, lambda: marks.mark("pre"), lambda: marks.mark("Blast")
    )
    gpt_model_class.forward = around(gpt_model_class.forward, marks.forward_starts, marks.forward_ends)


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


def main(argv: list[str]) -> int:
    if argv[:1] == ["--summary"]:
        rows = {path: summary(Path(path).read_text()) for path in argv[1:]}
        print(table(rows, base=next(iter(rows), None)), end="")
        return 0
    snapshots: tuple[int, str] | None = None
    if argv[:1] == ["--snapshot-forwards"]:
        snapshots, argv = (int(argv[1]), argv[2]), argv[3:]
    import torch
    import torch.distributed as dist

    from megatron_offload import run

    try:
        from megatron.core.models.gpt import gpt_model
        from megatron.core.pipeline_parallel import schedules
        from megatron.training import training
    except ImportError:
        return run.main(argv)  # which says what is missing, in one line

    def say(text: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(text, flush=True)

    def snapshot(iteration: int, forward: int) -> None:
        if snapshots is not None and iteration == snapshots[0]:
            rank = f"-rank{dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""
            with open(f"{snapshots[1]}-F{forward}{rank}.pickle", "wb") as handle:
                pickle.dump(torch.cuda.memory._snapshot(), handle)  # the allocator's books: no device sync

    marks = Marks(lambda: torch.cuda.Event(enable_timing=True), say, snapshot)
    install(marks, training, schedules, gpt_model.GPTModel)
    atexit.register(marks.at_exit)
    return run.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
