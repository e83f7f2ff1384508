"""One nightly run as a child process: its log streamed to a file, its progress shown, a hung run killed;
and the provenance line (versions, commit, device) of the report."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


class RunProgress:
    """One rich progress task per run on a terminal; one plain line per iteration elsewhere (CI logs)."""

    def __init__(self, names: list[str]) -> None:
        self.bars: Any = None
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            return
        if Console(stderr=True).is_terminal:
            columns = (TextColumn("{task.description:12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.bars = Progress(*columns, TextColumn("{task.fields[note]}"), console=Console(stderr=True))
            self.tasks = {name: self.bars.add_task(name, total=None, note="waiting") for name in names}

    def __enter__(self) -> RunProgress:
        if self.bars:
            self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars:
            self.bars.stop()

    def update(self, name: str, iteration: int, total: int, step_ms: str) -> None:
        if self.bars:
            self.bars.update(self.tasks[name], completed=iteration, total=total, note=f"{step_ms} ms/iter")
        else:
            print(f"[{name}] iteration {iteration}/{total} ({step_ms} ms)", file=sys.stderr, flush=True)

    def finish(self, name: str, note: str) -> None:
        if self.bars:
            self.bars.update(self.tasks[name], note=note)
        else:
            print(f"[{name}] {note}", file=sys.stderr, flush=True)


def run_one(name: str, command: list[str], args: argparse.Namespace, progress: RunProgress) -> int:
    """Run one configuration, streaming its output to DIR/<name>.log; its exit status."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    from megatron_offload.config.files import needs_one_connection

    if needs_one_connection(command):
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core requires it with TP or CP > 1
    options: dict[str, Any] = {"cwd": ROOT, "env": env, "text": True, "bufsize": 1, "start_new_session": True}
    with open(args.out / f"{name}.log", "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **options)

        def kill(reason: str) -> None:  # torchrun and its ranks share the process group started above
            if process.poll() is None:
                log.write(f"\n[nightly] {reason}: killing the run\n")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)

        # A hung NCCL job must not hang the nightly, nor outlive an interrupted one.
        watchdog = threading.Timer(args.timeout_min * 60, kill, (f"still running after {args.timeout_min} min",))
        watchdog.start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                if match := ITERATION.search(line):
                    progress.update(name, int(match[1]), int(match[2]), match[3])
            returncode = process.wait()
        finally:
            watchdog.cancel()
            kill("interrupted")
    progress.finish(name, "done" if returncode == 0 else f"exit {returncode}")
    return returncode


def environment() -> dict[str, str | None]:
    """Versions, repository commit and GPU name: the provenance line of the report."""

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def output(command: list[str]) -> str | None:
        try:
            return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    # The device machine's copy of the tree may carry a .git of another commit: the one passed in wins.
    commit = os.environ.get("MEGATRON_OFFLOAD_COMMIT")
    if not commit:
        commit = output(["git", "rev-parse", "HEAD"])
        if commit and output(["git", "status", "--porcelain", "--untracked-files=no"]):
            commit += " (with uncommitted changes)"
    names = (output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) or "").splitlines()
    device = f"{len(names)} x {names[0]}" if len(set(names)) == 1 and len(names) > 1 else ", ".join(names)
    return {"torch": version("torch"), "megatron_core": version("megatron-core"), "commit": commit, "device": device}
