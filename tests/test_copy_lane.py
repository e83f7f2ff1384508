"""The copy lanes' scheduling, without a GPU: copies stand in as jobs whose completion the test controls.

What these prove: jobs are issued in order (urgent ones first), never more than ``max_in_flight`` at
once, never before what they depend on has finished, and the memory they read is freed only once
they have completed; failures reach whoever waits. The engine tests then run the same lanes.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_offload.copy_lane import CopyJob, CopyLane, CopyLaneError
from megatron_offload.engine import LANE_DEPTH
from tests.test_engine_cpu import many_masters, offloader_for, set_grads


class Gate:
    """A completion that finishes when the test says so."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def open(self) -> None:
        self.opened.set()

    def synchronize(self) -> None:
        assert self.opened.wait(timeout=10), "a gate was never opened"


class Recorder:
    """Issues stand-in copies, logging the order, and hands out one gate per job."""

    def __init__(self) -> None:
        self.issued: list[str] = []
        self.gates: dict[str, Gate] = {}

    def job(self, name: str, nbytes: int = 1, **kwargs) -> CopyJob:
        gate = self.gates.setdefault(name, Gate())

        def issue() -> Gate:
            self.issued.append(name)
            return gate

        return CopyJob(issue, nbytes, **kwargs)


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_one_copy_in_flight_and_urgent_jobs_go_first() -> None:
    lane, recorder = CopyLane("test"), Recorder()
    jobs = [lane.submit(recorder.job(name)) for name in ("a", "b", "c")]
    wait_until(lambda: recorder.issued == ["a"])
    time.sleep(0.05)
    assert recorder.issued == ["a"]  # b waits for a to complete
    urgent = lane.submit(recorder.job("urgent", urgent=True))
    recorder.gates["a"].open()
    wait_until(lambda: len(recorder.issued) == 2)
    assert recorder.issued == ["a", "urgent"]  # ahead of b and c, which were queued first
    for name in ("urgent", "b", "c"):
        recorder.gates[name].open()
    for job in [*jobs, urgent]:
        job.synchronize()
    assert recorder.issued == ["a", "urgent", "b", "c"] and lane.peak_in_flight == 1
    lane.close()


def test_more_in_flight_when_allowed() -> None:
    lane, recorder = CopyLane("test", max_in_flight=2), Recorder()
    jobs = [lane.submit(recorder.job(name)) for name in ("a", "b", "c")]
    wait_until(lambda: recorder.issued == ["a", "b"])
    time.sleep(0.05)
    assert recorder.issued == ["a", "b"]
    for gate in ("a", "b", "c"):
        recorder.gates[gate].open()
    for job in jobs:
        job.synchronize()
    assert lane.peak_in_flight == 2
    lane.close()


def test_a_copy_is_issued_only_after_what_it_depends_on() -> None:
    lane, recorder, dependency = CopyLane("test"), Recorder(), Gate()
    job = lane.submit(recorder.job("a", ready=dependency))
    time.sleep(0.05)
    assert recorder.issued == [] and not job.issued.is_set()
    dependency.open()
    wait_until(job.issued.is_set)
    assert recorder.issued == ["a"]
    recorder.gates["a"].open()
    job.synchronize()
    lane.close()


def test_memory_is_freed_only_once_its_copy_has_completed() -> None:
    lane, gate = CopyLane("test"), Gate()

    def issuer(view: torch.Tensor):  # holds a view of the memory, as the engine's copies do
        return lambda: (view.sum(), gate)[1]

    block = torch.empty(1000)
    storage = block.untyped_storage()._weak_ref()
    job = CopyJob(issuer(block[10:20]), 4000, keep=[block])
    del block
    lane.submit(job)
    wait_until(job.issued.is_set)
    time.sleep(0.05)
    assert not torch.UntypedStorage._expired(storage) and lane.pending_bytes == 4000
    gate.open()
    job.synchronize()
    assert torch.UntypedStorage._expired(storage) and lane.pending_bytes == 0
    torch.UntypedStorage._free_weak_ref(storage)
    lane.close()


def test_drain_waits_for_the_oldest_jobs_until_enough_is_freed() -> None:
    lane, recorder = CopyLane("test"), Recorder()
    jobs = [lane.submit(recorder.job(name, nbytes=100)) for name in ("a", "b", "c")]
    recorder.gates["a"].open()
    recorder.gates["b"].open()
    assert lane.drain(150) == 200  # a alone frees too little: b too, and c is left alone
    assert jobs[1].done.is_set() and not jobs[2].done.is_set() and lane.pending_bytes == 100
    recorder.gates["c"].open()
    assert lane.drain() == 100 and lane.pending_bytes == 0
    lane.close()


def test_a_failed_copy_reaches_whoever_waits_and_the_lane_goes_on() -> None:
    lane, recorder = CopyLane("test"), Recorder()

    def broken() -> None:
        raise ValueError("device lost")

    failed = lane.submit(CopyJob(broken, 10, label="chunk 2 of 5 (10 B), GPU to host"))
    with pytest.raises(CopyLaneError, match=r"failed: chunk 2 of 5 \(10 B\), GPU to host, .*ValueError: device lost"):
        failed.synchronize(timeout=5)
    after = lane.submit(recorder.job("b"))
    recorder.gates["b"].open()
    after.synchronize(timeout=5)
    assert lane.pending_bytes == 0
    with pytest.raises(CopyLaneError, match="chunk 2 of 5"):
        lane.check()  # the first failure stays on record for the training thread
    assert lane.close(timeout=5)


def test_the_streamed_step_frees_every_block_and_keeps_few_copies_in_flight() -> None:
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    for step in range(3):
        set_grads(optimizer, step)
        offloader.prefetch(max_bytes=offloader.offloaded_bytes // 2)  # some back early, the rest streamed
        blocks = [chunk.gpu.untyped_storage()._weak_ref() for chunk in offloader._chunks if chunk.gpu is not None]
        with offloader.params_on_device():
            offloader.run_step()
        assert 0 < len(blocks) < len(offloader._chunks)
        offloader.drain_offloads()
        assert offloader.pending_offload_bytes == 0
        assert all(torch.UntypedStorage._expired(block) for block in blocks)
        for block in blocks:
            torch.UntypedStorage._free_weak_ref(block)
    lanes = (offloader._offload_lane, offloader._prefetch_lane)
    assert all(1 <= lane.peak_in_flight <= LANE_DEPTH for lane in lanes)
    offloader.restore()
    assert offloader._offload_lane is None  # the lanes' threads are stopped
