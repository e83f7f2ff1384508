"""The bounded runner every drill's child runs under (the crash entries of tests/drills/integration.py and
tests/gpu/host_memory_drill.py), and what a verdict says of a run it had to stop.

Why a bounded runner. The first GPU try of the crash entries never came back from its killed run:
megatron-core 0.19's torch_dist save starts a ``multiprocessing`` Manager process (spawned, for its write
results) and its resource tracker (the H100 run also left torch inductor's compile worker); a process
killed with SIGKILL runs no finalizer, so they outlive it, holding the stdout pipe that
``subprocess.run(capture_output=True)`` read to its end, and torchrun starts its workers in a session of
their own, so nothing that signals torchrun's group reaches them. Here every run writes its log straight
to a file (a leftover process cannot hold the drill), has a time bound, and carries a token in its
environment by which every process it started is found and killed: at the bound (the whole process group
and every process with the token, whatever session it moved to), and after it ended (what it left
behind, reported). A run stopped at a bound ends its entry with a verdict naming the run, its phase and
its last log lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.drills.drill_processes import RUN_TOKEN, kill_run, reap_leftovers

CRASH_MARKER = "megatron-offload crash drill: SIGKILL"  # tests/gpu/crash_driver.py's line before its kill
_ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \|")
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")


# ------------------------------------------------------------------------------------ bounded runs
@dataclass(frozen=True)
class Bounds:
    """How long a drill waits. A run past ``run_s`` is killed with everything it started."""

    run_s: float = 150.0  # any one run, start to exit (a tiny.yaml run takes about 30 s on an H100)
    after_kill_s: float = 45.0  # the killed run, from its SIGKILL line to its exit (torchrun notices in ~1 s)
    linger_s: float = 5.0  # processes a run leaves behind get this long to end by themselves


@dataclass
class Outcome:
    """How one bounded run ended."""

    returncode: int | None  # None: stopped by the drill before it ended
    seconds: float
    stopped: str | None  # why the drill stopped it (a bound, a watch's reason); None when it ended by itself
    left_behind: list[str] = field(default_factory=list)  # its processes alive after it ended ("pid command")
    killed: list[str] = field(default_factory=list)  # what the drill killed when it stopped the run
    text: str = ""


Watch = Callable[[str, float], str | None]  # (log so far, seconds since start) -> a reason to stop it now


_live: dict[str, int] = {}  # runs under way: token -> pid (their process group), for kill_live_runs()


def kill_live_runs() -> None:
    """Kill every run under way, with everything it started (a drill on its way out leaves none behind)."""
    for token, pid in list(_live.items()):
        kill_run(pid, token)


def exit_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a scheduler) end the drill with its runs killed: by default Python dies at
    once and leaves the runs under way (each in a session of its own) behind."""

    def stop(signum: int, frame: Any) -> None:
        kill_live_runs()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def run_bounded(
    command: list[str],
    log_path: Path,
    *,
    bound_s: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    watch: Watch | None = None,
    linger_s: float = 5.0,
    poll_s: float = 0.2,
) -> Outcome:
    """Run ``command`` with its output in ``log_path``; never wait past ``bound_s`` (plus the seconds a
    SIGKILL takes). The log is a file, not a pipe: a descendant that outlives the run cannot hold us."""
    token = uuid.uuid4().hex
    full_env = {**(os.environ if env is None else env), RUN_TOKEN: token, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    stopped = None
    killed: list[str] = []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as one at a bound
        )
        _live[token] = process.pid
        try:
            reader = _LogReader(log_path)
            while process.poll() is None:
                elapsed = time.monotonic() - start
                if elapsed > bound_s:
                    stopped = f"no exit within {bound_s:g} s"
                    break
                reason = watch(reader.read(), elapsed) if watch is not None else None
                if reason:
                    stopped = reason
                    break
                time.sleep(poll_s)
        finally:
            if process.poll() is None:  # at a bound, or the drill itself is being interrupted
                killed = kill_run(process.pid, token)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:  # unkillable (a process stuck in the kernel): say so
                    stopped = f"{stopped or 'stopped'}; still not gone 30 s after SIGKILL"
            _live.pop(token, None)
    left_behind = reap_leftovers(token, linger_s) if stopped is None else []
    text = log_path.read_text(errors="replace")
    returncode = None if stopped else process.poll()
    return Outcome(returncode, time.monotonic() - start, stopped, left_behind, killed, text)


class _LogReader:
    """The log so far, read incrementally (a watch looks at it several times a second)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.text = path, 0, ""

    def read(self) -> str:
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            chunk = file.read()
        self.offset += len(chunk)
        self.text += chunk.decode(errors="replace")
        return self.text


def last_iteration(text: str) -> int | None:
    """The last iteration Megatron logged, or None before the first."""
    found = _ITERATION.findall(text)
    return int(found[-1]) if found else None


def phase(text: str) -> str:
    """Where a Megatron run was, from its log: what a verdict names."""
    iteration = last_iteration(text)
    where = f"after iteration {iteration}" if iteration is not None else "before its first iteration"
    if CRASH_MARKER in text:
        return f"{where}, after its SIGKILL line"
    loaded = LOADED.findall(text)
    if loaded and iteration is None:
        return f"after loading the checkpoint of iteration {loaded[-1]}, before its first iteration"
    return where


def tail(text: str, lines: int = 5) -> str:
    """The last non-empty log lines, joined on one line."""
    kept = [line.strip()[:240] for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "(empty log)"


def verdict(name: str, outcome: Outcome) -> str:
    """One sentence for a run the drill had to stop: which run, why, where, what it said last."""
    where, last = phase(outcome.text), tail(outcome.text)
    return f"{name} run stopped by the drill: {outcome.stopped} ({where}); last log lines: {last}"


def torchrun(gpus: int) -> list[str]:
    """The launcher of a GPU run: Megatron initializes torch.distributed from torchrun's environment."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
