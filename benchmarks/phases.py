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
    python -m benchmarks.phases --allocator SCRIPT [ARGS...]
                                                     also, per phase, the caching allocator's retries (each
                                                     synchronizes every stream), its calls that mapped and
                                                     unmapped device memory, the host's ms in Python's
                                                     garbage collector and in this project's hooks, the CPU ms
                                                     of the main thread and of all others, the main thread's
                                                     ms runnable without a CPU, kernel ms, page faults, involuntary
                                                     switches and the machine's stolen ms, on a second line
    python -m benchmarks.phases --link SCRIPT [ARGS...]
                                                     also, at exit, per phase of each iteration, the ms the host
                                                     link carried optimizer state each way and the compute stream
                                                     waited for it, where the link stood still from the last
                                                     backward to the next first forward, and, after each step,
                                                     what the last backward brought back and what bounded it
                                                     (phase_probes.py)
    python -m benchmarks.phases --snapshot-oom PATH SCRIPT [ARGS...]
                                                     where an allocation fails, the allocator's snapshot then
                                                     (PATH-oom.pickle) and the Python stack that asked (PATH-oom.txt)
    python -m benchmarks.phases --summary LOG ...    each log's medians per phase (iterations 4 on), and its logged
                                                     ms an iteration beside their sum (the rest is outside train_step)

Options combine, in any order before SCRIPT.

Only ``forward_backward_no_pipelining`` is marked: with pipeline parallelism ``pre`` and ``Blast`` are missing.
"""

from __future__ import annotations

import atexit
import functools
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import phase_lines
from benchmarks.phase_lines import ALLOCATOR_COUNTERS, Event, Mark, counter_line, line, outside_lines, summary, table
from benchmarks.phase_probes import LinkTimeline, bring_back_summary, link_summary, note_bring_back, time_hooks


class Marks:
    """Events of the iterations under way; one line for each once it has completed."""

    def __init__(
        self,
        event: Callable[[], Event],
        say: Callable[[str], None],
        after_forward: Callable[[int, int], None] | None = None,
        counters: Callable[[], tuple[float, ...]] | None = None,
        first_iteration: Callable[[], None] | None = None,
        on_done: Callable[[list[Mark]], None] | None = None,
    ) -> None:
        self.event = event
        self.say = say
        self.after_forward = after_forward  # called with (iteration, forward) as each forward ends
        self.counters = counters  # the counters of COUNTED (the allocator's, the host's ms), read at each mark
        self.first_iteration = first_iteration  # called as the first iteration starts (CUDA set up by then)
        self.on_done = on_done  # called with each whole iteration's marks as its line is said
        self.iterations = 0
        self.current: list[Mark] = []  # (phase ending here, event, host time, counters)
        self.done: list[list[Mark]] = []  # whole iterations, events maybe still running
        self.forwards = 0

    def mark(self, phase: str) -> None:
        event = self.event()
        event.record()
        counted = self.counters() if self.counters is not None else ()
        self.current.append((phase, event, time.perf_counter(), counted))

    def iteration_starts(self) -> None:
        if self.current:
            self.done.append(self.current)
        self.current, self.forwards = [], 0
        self.iterations += 1
        if self.iterations == 1 and self.first_iteration is not None:
            self.first_iteration()
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
            if self.on_done is not None:
                self.on_done(marks)
            if self.counters is not None:
                self.say(counter_line(marks))

    def at_exit(self) -> None:
        if self.current and self.current[-1][0] == "step":
            self.done.append(self.current)
            self.current = []
        self.flush(wait=True)


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


def options(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The options before SCRIPT: ``--snapshot-forwards N PATH``, ``--snapshot-oom PATH``, ``--allocator``,
    ``--link``."""
    found: dict[str, Any] = {}
    while argv[:1] and argv[0] in ("--snapshot-forwards", "--snapshot-oom", "--allocator", "--link"):
        if argv[0] == "--snapshot-forwards":
            found["forwards"], argv = (int(argv[1]), argv[2]), argv[3:]
        elif argv[0] == "--snapshot-oom":
            found["oom"], argv = argv[1], argv[2:]
        else:
            found[argv[0][2:]], argv = True, argv[1:]
    return found, argv


def main(argv: list[str]) -> int:
    if argv[:1] == ["--summary"]:
        texts = {path: Path(path).read_text() for path in argv[1:]}
        rows = {path: summary(text) for path, text in texts.items()}
        print(table(rows, base=next(iter(rows), None)) + outside_lines(texts, rows), end="")
        links = {path: link_summary(text) for path, text in texts.items()}
        if any(links.values()):  # runs with --link: each phase's median ms of copies out (copies in)
            print("link, out (in) ms:\n" + table({p: row for p, row in links.items() if row}), end="")
        backs = {path: bring_back_summary(text) for path, text in texts.items()}
        print(*(f"{path}: {backs[path]}\n" for path in filter(backs.get, backs)), sep="", end="")  # --link runs
        return 0
    found, argv = options(argv)
    import torch
    import torch.distributed as dist

    from megatron_offload import run

    try:
        from megatron.core.models.gpt import gpt_model
        from megatron.core.pipeline_parallel import schedules
        from megatron.training import training
    except ImportError:
        return run.main(argv)  # which says what is missing, in one line

    def rank() -> str:
        return f"-rank{dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""

    def say(text: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(text, flush=True)

    def snapshot(iteration: int, forward: int) -> None:
        if "forwards" in found and iteration == found["forwards"][0]:
            with open(f"{found['forwards'][1]}-F{forward}{rank()}.pickle", "wb") as handle:
                pickle.dump(torch.cuda.memory._snapshot(), handle)  # the allocator's books: no device sync

    def out_of_memory(device: int, asked: int, limit: int, free: int) -> None:
        # Called by the allocator as an allocation fails, its lock released, before the error is raised.
        with open(f"{found['oom']}-oom{rank()}.pickle", "wb") as handle:
            pickle.dump(torch.cuda.memory._snapshot(), handle)
        stack = "".join(traceback.format_stack()[:-1])
        Path(f"{found['oom']}-oom{rank()}.txt").write_text(f"asked {asked} bytes, limit {limit}\n{stack}")

    host_ms = {"gc": 0.0, "hooks": 0.0}
    if found.get("allocator"):
        time_hooks(host_ms)

    def counters() -> tuple[float, ...]:
        stats = torch._C._cuda_memoryStats(torch.cuda.current_device())
        allocator = tuple(int(stats.get(name, 0)) for name in ALLOCATOR_COUNTERS)
        # The kernel's per-thread and per-process CPU clocks (a call each, no /proc walk), the time this thread
        # stood runnable without a core (schedstat, 0 where the kernel keeps none), the machine's stolen time.
        main_cpu, all_cpu = time.thread_time() * 1e3, time.process_time() * 1e3
        stood, stolen = phase_lines.runqueue_ms(), phase_lines.stolen_ms()
        hosts = (host_ms["gc"], host_ms["hooks"], main_cpu, all_cpu - main_cpu, stood, stolen)
        return (*allocator, *(round(ms, 2) for ms in (*hosts, *phase_lines.thread_usage())))

    def first_iteration() -> None:
        # Not before: attaching starts the allocator, which reads its settings (expandable segments) once.
        if "oom" in found:
            torch._C._cuda_attach_out_of_memory_observer(out_of_memory)

    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    link = LinkTimeline() if found.get("link") else None
    if link is not None:
        link.install()
        note_bring_back(say)
    on_done = link.iteration if link is not None else None
    marks = Marks(event, say, snapshot, counters if found.get("allocator") else None, first_iteration, on_done)
    install(marks, training, schedules, gpt_model.GPTModel)

    def at_exit() -> None:
        marks.at_exit()
        if link is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # at exit: every copy's events complete before they are read
            for text in link.lines():
                say(text)

    atexit.register(at_exit)
    return run.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
