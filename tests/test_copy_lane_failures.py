"""Every way a copy lane can fail, on the CPU: the failure reaches the waiting thread as one error that
names the chunk, the memory the copies read is kept, and nothing blocks. Each test runs under a time
bound (``bounded``) and every wait in it has a timeout of its own, so a hang fails instead of hanging.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from megatron_offload.copy_lane import CopyJob, CopyLane, CopyLaneError
from tests.test_copy_lane import Gate, Recorder, wait_until

LABEL = "chunk 3 of 17 (64.0 MiB), GPU to host"


def bounded(seconds: float):
    """Run the test body in a thread and fail if it has not finished within ``seconds``."""

    def decorate(test):
        @functools.wraps(test)
        def run(*args, **kwargs) -> None:
            outcome: list[BaseException | None] = []

            def body() -> None:
                try:
                    test(*args, **kwargs)
                    outcome.append(None)
                except BaseException as error:
                    outcome.append(error)

            thread = threading.Thread(target=body, daemon=True)
            thread.start()
            thread.join(seconds)  # bounded: a test that hangs fails here instead
            assert not thread.is_alive(), f"{test.__name__} did not finish within {seconds} s (a hang)"
            if outcome[0] is not None:
                raise outcome[0]

        return run

    return decorate


def gpu_block() -> tuple[torch.Tensor, object]:
    """A stand-in for a chunk's GPU block and a weak reference that tells whether it was freed."""
    block = torch.empty(1000)
    return block, block.untyped_storage()._weak_ref()


def freed(storage: object) -> bool:
    return torch.UntypedStorage._expired(storage)


@bounded(20)
def test_setup_that_raises_fails_every_job_and_refuses_new_ones() -> None:
    def setup() -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    lane = CopyLane("out", setup)
    job = lane.submit(Recorder().job("a", label=LABEL))
    with pytest.raises(CopyLaneError, match=rf"{LABEL[:8]}.*setup failed \(RuntimeError: CUDA error: invalid device"):
        job.synchronize(timeout=5)
    with pytest.raises(CopyLaneError, match="chunk 4 was not started: .*copy lane out its thread's setup failed"):
        lane.submit(Recorder().job("b", label="chunk 4"))
    with pytest.raises(CopyLaneError, match="setup failed"):
        lane.check()
    assert lane.pending_bytes == 0 and lane.close(timeout=5)


@bounded(20)
def test_issue_that_raises_midway_keeps_the_memory_its_queued_copies_read() -> None:
    lane, queued_copy = CopyLane("out"), Gate()
    block, storage = gpu_block()

    def issue() -> None:
        queued_copy.opened.clear()  # a copy of ``block`` is now queued on the stream ...
        raise RuntimeError("out of pinned memory")  # ... and the next one could not be

    job = lane.submit(CopyJob(issue, 4000, keep=[block], label=LABEL))
    del block
    with pytest.raises(CopyLaneError, match=rf"{LABEL[:8]}.*while queuing its copies \(RuntimeError: out of pinned"):
        job.wait_issued(timeout=5)
    with pytest.raises(CopyLaneError, match="the memory it read is kept"):
        job.synchronize(timeout=5)
    assert not freed(storage) and job.keep, "a failed job freed memory its queued copies may still read"
    assert isinstance(job.error, CopyLaneError) and isinstance(job.error.__cause__, RuntimeError)
    assert lane.pending_bytes == 0  # the bytes are the engine's again: it points the chunk back at keep[0]
    recorder = Recorder()
    after = lane.submit(recorder.job("next"))
    recorder.gates["next"].open()
    after.synchronize(timeout=5)  # the lane goes on with other chunks
    with pytest.raises(CopyLaneError, match=LABEL[:8]):
        lane.check()
    job.keep.clear()
    assert freed(storage)
    torch.UntypedStorage._free_weak_ref(storage)
    assert lane.close(timeout=5)


class FailingCopy:
    """A completion whose copy reports an error when waited for (as an event after a failed copy)."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@bounded(20)
def test_copy_error_is_named_and_the_gpu_block_is_kept_for_the_engine() -> None:
    lane = CopyLane("out")
    block, storage = gpu_block()
    job = lane.submit(CopyJob(lambda: FailingCopy(), 4000, keep=[block], label=LABEL))
    del block
    with pytest.raises(CopyLaneError, match=rf"{LABEL[:8]}.*lane out, while copying \(RuntimeError: CUDA error: an"):
        job.synchronize(timeout=5)
    assert not freed(storage) and job.done.is_set()
    with pytest.raises(CopyLaneError, match="while copying"):
        lane.drain()  # drain cannot report everything freed while a job failed
    torch.UntypedStorage._free_weak_ref(storage)
    assert lane.close(timeout=5)


@bounded(20)
def test_a_dependency_that_fails_stops_the_copy_before_it_is_issued() -> None:
    lane, recorder = CopyLane("in"), Recorder()
    job = lane.submit(recorder.job("a", ready=FailingCopy(), label="chunk 1 of 2, host to GPU"))
    with pytest.raises(CopyLaneError, match="chunk 1 of 2, host to GPU.*while waiting for what it depends on"):
        job.wait_issued(timeout=5)
    assert recorder.issued == []
    assert lane.close(timeout=5)


@bounded(20)
def test_a_thread_that_stops_fails_its_jobs() -> None:
    lane = CopyLane("out")

    def serve_jobs() -> None:
        raise SystemError("bug in the lane")

    lane._serve_jobs = serve_jobs
    job = lane.submit(Recorder().job("a", label=LABEL))
    with pytest.raises(CopyLaneError, match=r"its thread stopped \(SystemError: bug in the lane\)"):
        job.synchronize(timeout=5)
    assert lane.close(timeout=5)


@bounded(20)
def test_a_wait_with_a_timeout_names_the_stuck_chunk() -> None:
    lane, recorder = CopyLane("out"), Recorder()
    job = lane.submit(recorder.job("a", label=LABEL))
    start = time.monotonic()
    with pytest.raises(CopyLaneError, match=rf"{LABEL[:8]}.*was not completed within 0.2 s"):
        job.synchronize(timeout=0.2)
    assert time.monotonic() - start < 2
    recorder.gates["a"].open()
    job.synchronize(timeout=5)
    assert lane.close(timeout=5)


@bounded(30)
def test_close_gives_up_on_a_stuck_completion_and_says_so(capfd: pytest.CaptureFixture[str]) -> None:
    lane, recorder = CopyLane("megatron-offload-out"), Recorder()
    stuck = lane.submit(recorder.job("a", label=LABEL))
    wait_until(lambda: recorder.issued == ["a"])
    start = time.monotonic()
    assert lane.close(timeout=0.3) is False
    assert time.monotonic() - start < 3
    message = capfd.readouterr().err
    assert f"copy lane megatron-offload-out did not finish within 0.3 s (stuck on {LABEL})" in message
    assert len(message.strip().splitlines()) == 1
    with pytest.raises(CopyLaneError, match="left behind"):
        stuck.synchronize(timeout=5)  # its waiters are released with the reason
    with pytest.raises(CopyLaneError, match="was not started"):
        lane.submit(recorder.job("b"))
    recorder.gates["a"].open()  # the stray thread ends on its own, and counts nothing twice
    wait_until(lambda: not lane._thread.is_alive())
    assert lane.pending_bytes == 0


def test_process_exit_is_bounded_with_a_stuck_copy() -> None:
    script = textwrap.dedent(
        """
        import threading
        from megatron_offload.copy_lane import CopyJob, CopyLane
        never = threading.Event()
        class Stuck:
            def synchronize(self):
                never.wait()  # an event that never completes (a collective hung elsewhere)
        lane = CopyLane("megatron-offload-out")
        lane.submit(CopyJob(lambda: Stuck(), 64, label="chunk 1 of 1 (64 B), GPU to host"))
        print("exiting", flush=True)
        """
    )
    env = {**os.environ, "MEGATRON_OFFLOAD_EXIT_TIMEOUT_S": "0.5", "PYTHONPATH": os.getcwd()}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30
    assert result.returncode == 0 and result.stdout == "exiting\n", result.stderr
    assert "did not finish within 0.5 s (stuck on chunk 1 of 1 (64 B), GPU to host)" in result.stderr


def wait_for_child(pid: int, seconds: float = 20) -> int:
    """The child's exit code, or kill it and fail if it has not exited in time (it hung)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")


def child_refuses_the_lane(lane: CopyLane, job: CopyJob) -> int:
    """In a forked child: every use of the parent's lane fails at once with the reason. 0 if so."""
    try:
        with pytest.raises(CopyLaneError, match=r"is a fork of it \(a data-loader worker\?\)"):
            job.synchronize(timeout=5)
        with pytest.raises(CopyLaneError, match="was not started"):
            lane.submit(Recorder().job("in the child"))
        assert lane._lock.acquire(timeout=1)  # not held, whatever the parent's thread was doing
        lane._lock.release()
        return 0 if lane.close(timeout=1) else 3
    except BaseException as error:
        print(f"child: {error!r}", file=sys.stderr, flush=True)
        return 1


@bounded(40)
def test_fork_while_a_job_is_in_flight() -> None:
    lane, recorder = CopyLane("out"), Recorder()
    job = lane.submit(recorder.job("a", nbytes=64, label=LABEL))
    wait_until(lambda: recorder.issued == ["a"])  # issued, its completion not reached: in flight
    pid = os.fork()
    if pid == 0:
        os._exit(child_refuses_the_lane(lane, job))
    assert wait_for_child(pid) == 0
    recorder.gates["a"].open()  # the parent's lane is untouched by the fork
    job.synchronize(timeout=5)
    assert lane.pending_bytes == 0 and lane.close(timeout=5)


class CheckingDataset(torch.utils.data.Dataset):
    """A data loader's dataset that, in each forked worker, finds the training process's lane refused."""

    def __init__(self, lane: CopyLane, job: CopyJob) -> None:
        self.lane, self.job = lane, job

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return child_refuses_the_lane(self.lane, self.job) * 100 + index


@bounded(60)
def test_data_loader_workers_forked_while_a_copy_is_in_flight() -> None:
    lane, recorder = CopyLane("out"), Recorder()
    job = lane.submit(recorder.job("a", label=LABEL))
    wait_until(lambda: recorder.issued == ["a"])
    loader = torch.utils.data.DataLoader(
        CheckingDataset(lane, job), batch_size=2, num_workers=2, multiprocessing_context="fork", timeout=30
    )
    assert [int(x) for batch in loader for x in batch] == list(range(8))  # every worker saw a refusing lane
    recorder.gates["a"].open()
    job.synchronize(timeout=5)
    assert lane.close(timeout=5)
