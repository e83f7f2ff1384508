"""The crash drill's bounds, on the CPU with real subprocesses (no GPU, no Megatron): a run that hangs,
a launcher whose child ignores SIGTERM in a session of its own, an orphan that outlives a killed run
(what once hung a GPU drill), and a drill interrupted or ended with SIGTERM itself. Each ends with a
verdict within its bound, or with no run left behind; nothing of the bound logic is mocked. Whole crash
entries are test_crash_entry_bounds.py's.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.drills import drill_processes, drill_runs

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the drill reads processes from /proc")

SLEEPER = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(1e6)"

LAUNCHER = """
import os, subprocess, sys
# As torchrun: the worker in a session of its own, and a wait with no bound.
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print("launcher", os.getpid(), "child", child.pid, flush=True)
child.wait()
"""

STUBBORN_CHILD = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("session", os.getsid(0), flush=True)
print(" iteration       12/      20 | consumed samples:           96 |", flush=True)
time.sleep(1e6)
"""

# What megatron-core 0.19's torch_dist save does once per process (a spawned Manager for its write
# results), then the crash drill's SIGKILL: the Manager and its resource tracker outlive the worker.
KILLED_WORKER = """
import multiprocessing, os, signal
if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Manager().Queue()
    print("megatron-offload crash drill: SIGKILL after the step of iteration 13", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]


def loopback_problem() -> str | None:
    """Why ``torchrun --standalone`` cannot meet its workers here (its rendezvous listens on localhost and
    connects to it), or None where it can."""
    try:
        server = socket.create_server(("localhost", 0))
        with server, socket.create_connection(("localhost", server.getsockname()[1]), timeout=5):
            pass
    except OSError as error:
        return f"torchrun --standalone needs loopback networking (localhost), which this machine lacks: {error}"
    return None


LOOPBACK = loopback_problem()
needs_loopback = pytest.mark.skipif(LOOPBACK is not None, reason=LOOPBACK or "")


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def pids(text: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"(?:pid|launcher|child) (\d+)", text)]


def test_a_child_that_sleeps_forever_ends_at_its_bound_with_a_verdict(tmp_path: Path) -> None:
    start = time.monotonic()
    outcome = drill_runs.run_bounded([sys.executable, "-c", SLEEPER], tmp_path / "run.log", bound_s=2)
    assert time.monotonic() - start < 2 + 5
    assert outcome.stopped == "no exit within 2 s" and outcome.returncode is None
    assert pids(outcome.text) and not any(alive(pid) for pid in pids(outcome.text))
    verdict = drill_runs.verdict("resumed", outcome)
    assert verdict.startswith("resumed run stopped by the drill: no exit within 2 s (before its first iteration);")
    assert "last log lines: $ " in verdict and "pid" in verdict  # the log is a file, there from the start
    assert (tmp_path / "run.log").read_text() == outcome.text


def test_a_launcher_whose_child_ignores_sigterm_in_its_own_session_is_killed_whole(tmp_path: Path) -> None:
    command = [sys.executable, "-c", LAUNCHER, STUBBORN_CHILD]
    start = time.monotonic()
    outcome = drill_runs.run_bounded(command, tmp_path / "run.log", bound_s=3)
    assert time.monotonic() - start < 3 + 5
    launcher, child = pids(outcome.text)
    assert f"session {child}" in outcome.text  # out of the launcher's group: killpg alone would miss it
    assert not alive(launcher) and not alive(child)
    assert {int(line.split()[0]) for line in outcome.killed} >= {launcher, child}
    assert "(after iteration 12)" in drill_runs.verdict("killed", outcome)


@needs_loopback
def test_an_orphan_holding_the_output_pipe_would_hang_a_drill_that_reads_to_its_end(tmp_path: Path) -> None:
    """Why a drill that reads a run's output to its end hangs: torchrun has exited, its output pipe never ends."""
    script = tmp_path / "worker.py"
    script.write_text(KILLED_WORKER)
    token = "pipe-test"
    env = {**os.environ, drill_processes.RUN_TOKEN: token}
    command = [*TORCHRUN, str(script)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process.poll() not in (None, 0)  # torchrun saw its worker die and exited
        orphans = drill_processes.processes_of(token)
        assert any("multiprocessing" in drill_processes.describe(pid) for pid in orphans)
        with pytest.raises(subprocess.TimeoutExpired):
            process.communicate(timeout=3)  # subprocess.run(capture_output=True) waited here forever
    finally:
        drill_processes.kill_run(process.pid, token)
        process.communicate(timeout=30)


@needs_loopback
def test_a_killed_run_whose_orphans_outlive_it_comes_back_and_they_are_reaped(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(KILLED_WORKER)
    start = time.monotonic()
    outcome = drill_runs.run_bounded([*TORCHRUN, str(script)], tmp_path / "run.log", bound_s=60, linger_s=1)
    assert time.monotonic() - start < 60
    assert outcome.stopped is None and outcome.returncode not in (None, 0)
    assert drill_runs.CRASH_MARKER in outcome.text
    assert any("multiprocessing" in line for line in outcome.left_behind)  # reported, then killed
    assert not any(alive(int(line.split()[0])) for line in outcome.left_behind)


def test_the_drill_kills_its_run_when_it_is_interrupted_itself(tmp_path: Path) -> None:
    """A KeyboardInterrupt (or any error) in the drill leaves no run behind."""
    seen: list[int] = []

    def interrupt(text: str, elapsed: float) -> str | None:
        seen.extend(pids(text))
        if seen:
            raise KeyboardInterrupt
        return None

    with pytest.raises(KeyboardInterrupt):
        drill_runs.run_bounded([sys.executable, "-c", SLEEPER], tmp_path / "run.log", bound_s=30, watch=interrupt)
    assert seen and not alive(seen[0])


DRILL = """
import sys
from pathlib import Path

from tests.drills import drill_processes, drill_runs

drill_runs.exit_on_sigterm()
drill_runs.run_bounded([sys.executable, "-c", sys.argv[2]], Path(sys.argv[1]), bound_s=120)
"""


def test_a_drill_ended_with_sigterm_takes_its_run_with_it(tmp_path: Path) -> None:
    """``timeout`` or a scheduler ends the drill with SIGTERM: the run under way (in a session of its own,
    which no signal to the drill's group reaches) is killed on the way out."""
    log = tmp_path / "run.log"
    root = Path(__file__).resolve().parents[1]  # python -c puts the working directory on sys.path
    drill = subprocess.Popen([sys.executable, "-c", DRILL, str(log), SLEEPER], cwd=root)
    deadline = time.monotonic() + 30
    while not (log.exists() and pids(log.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    drill.terminate()
    assert drill.wait(timeout=30) == 128 + 15
    assert pids(log.read_text()) and not alive(pids(log.read_text())[0])
