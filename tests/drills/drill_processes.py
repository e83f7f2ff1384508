"""The processes of a bounded drill run (drill_runs.py), found by the token in their environment: each run
carries ``RUN_TOKEN`` and every process it starts inherits it, also one that leaves the run's process group.
Found, described and killed until none is left; what a run left behind after it ended, given time to end, then
killed (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

__all__ = ["RUN_TOKEN", "describe", "kill_run", "processes_of", "reap_leftovers"]

RUN_TOKEN = "MEGATRON_OFFLOAD_DRILL_RUN"  # in every bounded run's environment, inherited by its processes


def processes_of(token: str) -> list[int]:
    """Live processes whose environment carries this run's token (Linux /proc; empty elsewhere)."""
    needle = f"{RUN_TOKEN}={token}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environment = (entry / "environ").read_bytes()
        except OSError:  # gone, a zombie, or not ours
            continue
        if needle in environment.split(b"\0") and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return sorted(found)


def _descendants(pid: int) -> list[int]:
    """Children of ``pid`` and theirs, from /proc (a process that dropped its environment too)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def describe(pid: int) -> str:
    """``pid command line`` (shortened), or ``pid`` alone when it is gone."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"{pid} {command[:160]}".strip()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead: only its parent's wait is missing


def kill_run(pgid: int, token: str) -> list[str]:
    """SIGKILL a run's process group, its descendants and every process with its token, until none is
    left (a process may fork while we look). Returns what was signalled, as ``pid command``."""
    signalled: dict[int, str] = {}
    for _ in range(5):
        targets = {pid for pid in [*_descendants(pgid), *processes_of(token)] if _alive(pid)} - signalled.keys()
        if pgid not in signalled and _alive(pgid):
            targets.add(pgid)
        signalled |= {pid: describe(pid) for pid in targets}
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if not targets:
            break
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    deadline = time.monotonic() + 5  # gone, not only signalled: a run after this one starts clean
    while any(_alive(pid) for pid in signalled) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [signalled[pid] for pid in sorted(signalled)]


def reap_leftovers(token: str, linger_s: float) -> list[str]:
    """Processes the run left behind: given ``linger_s`` to end by themselves, then killed."""
    deadline = time.monotonic() + linger_s
    left = [pid for pid in processes_of(token) if _alive(pid)]
    described = {pid: describe(pid) for pid in left}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [pid for pid in left if _alive(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5  # a SIGKILL takes effect at once, but not within the same instant
    while any(_alive(pid) for pid in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [described[pid] for pid in left]
