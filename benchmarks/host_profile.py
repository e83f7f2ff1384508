"""Where the training thread's host time goes, rows side by side, from stacks py-spy sampled.

torch.profiler slows the host by about half (phases.py), and in Megatron-LM's loop without TransformerEngine the
host's pace decides the forward's. py-spy reads a running process from outside it: with ``--nonblocking`` it never
pauses the process, reads Python frames only, and drops a sample it could not read (about a quarter of them on the
lent H200s, alike in every row). With ``--native`` it pauses the process for every sample; there Megatron-LM's start
alone took 92 s and no row reached an iteration. A frame's samples count the time the thread spent in it, the
C++ and driver calls it made included; a thread that waits idle is not sampled.

Record each row while it trains (py-spy from its wheel: ``pip download --no-deps py-spy``, then on the GPU
machine ``pip install --no-index --target DIR`` it), once its timings settle:

    py-spy record --pid PID --nonblocking --threads --rate 250 --duration 12 --format raw -o ROW.spy

then

    python -m benchmarks.host_profile --seconds 12 [--within FRAME] [--top N] ROW.spy[:MS] ...

``MS``: the row's ms an iteration (its logged median), for samples an iteration instead of samples a second.
``FRAME``: the start of the frame to look within, by default Megatron-LM's ``forward_step`` (each micro-batch's
forward). For each row: the main thread's samples, those within FRAME, then the functions within FRAME (inclusive,
by file) and the innermost frames (by line) whose samples differ most from the first row's.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Profile", "main", "profile", "read_raw", "table"]

FORWARD = "forward_step (core/pipeline_parallel/schedules.py"
MAIN_THREAD = "MainThread"


def read_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw format: a line per distinct stack, outermost frame first, ``;`` between frames, then the
    count. A line without a count (a file cut short) is left out."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def by_file(frame: str) -> str:
    """``function (path:line)`` as ``function (path)``: a function's samples whichever line ran."""
    name, paren, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if paren and ":" in where else frame


@dataclass
class Profile:
    """One row: samples of the main thread, within the frame, and within it by function and by innermost frame."""

    main: float = 0
    within: float = 0
    functions: Counter = field(default_factory=Counter)
    leaves: Counter = field(default_factory=Counter)

    def scaled(self, per: float) -> Profile:
        """Every count divided by ``per`` (iterations or seconds the samples span)."""
        return Profile(
            self.main / per,
            self.within / per,
            Counter({k: v / per for k, v in self.functions.items()}),
            Counter({k: v / per for k, v in self.leaves.items()}),
        )


def profile(stacks: list[tuple[list[str], int]], within: str = FORWARD) -> Profile:
    """The main thread's samples (with py-spy's ``--threads`` its stacks start with a frame naming the thread;
    without it every stack counts), those with a frame starting with ``within``, and, of those, each function
    once per stack (inclusive, from that frame in), and the innermost frame."""
    threaded = any(stack[0].startswith("thread (") for stack, _ in stacks)
    result = Profile()
    for stack, count in stacks:
        if threaded and MAIN_THREAD not in stack[0]:
            continue
        result.main += count
        start = next((i for i, frame in enumerate(stack) if frame.startswith(within)), None)
        if start is None:
            continue
        result.within += count
        for name in {by_file(frame) for frame in stack[start:]}:
            result.functions[name] += count
        result.leaves[stack[-1]] += count
    return result


def table(names: list[str], rows: list[Profile], top: int, unit: str) -> str:
    """The rows side by side: totals, then the ``top`` functions and innermost frames whose samples differ most
    from the first row's."""
    width = max(8, *(len(name) for name in names))
    head = " ".join(f"{name:>{width}}" for name in names)

    def line(values: list[float], label: str) -> str:
        return " ".join(f"{value:>{width}.1f}" for value in values) + f"  {label}"

    out = [
        f"samples {unit}",
        f"{head}",
        line([r.main for r in rows], "main thread"),
        line([r.within for r in rows], "within"),
    ]
    for title, pick in (("functions", lambda r: r.functions), ("innermost frames", lambda r: r.leaves)):
        keys = set().union(*(pick(r) for r in rows))
        ranked = sorted(keys, key=lambda k: (-max(abs(pick(r)[k] - pick(rows[0])[k]) for r in rows), k))
        out += [f"{title}, by the largest difference from {names[0]}:"]
        out += [line([pick(r)[key] for r in rows], key) for key in ranked[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_profile", description=__doc__.split("\n")[0])
    parser.add_argument("rows", nargs="+", metavar="ROW.spy[:MS]")
    parser.add_argument(
        "--seconds", type=float, required=True, help="the span each profile sampled (py-spy's --duration)"
    )
    parser.add_argument("--within", default=FORWARD, help="the start of the frame to look within")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds {args.seconds}: give the span py-spy sampled, in seconds (its --duration)")
    names, rows, per_iteration = [], [], []
    for row in args.rows:
        path, _, ms = row.partition(":")
        if ms and not _positive(ms):
            parser.error(f"{row}: after the colon give the row's ms an iteration, a number above 0")
        if not Path(path).is_file():
            parser.error(f"{path}: no such profile; record one with py-spy record --format raw (see --help)")
        per_iteration.append(bool(ms))
        per = args.seconds * 1e3 / float(ms) if ms else args.seconds  # iterations the samples span, or seconds
        rows.append(profile(read_raw(Path(path).read_text()), args.within).scaled(per))
        names.append(Path(path).stem)
    if len(set(per_iteration)) > 1:
        parser.error("give every row's ms an iteration (ROW.spy:MS) or none: the rows are compared in one unit")
    print(table(names, rows, args.top, "an iteration" if per_iteration[0] else "a second"))
    return 0


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
