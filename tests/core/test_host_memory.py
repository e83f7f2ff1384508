"""Host-memory drills on the CPU: pinning refused, an allocation refused, a node too small for every
rank, and a host that runs short once training has started (the last two with the offloader, in
tests/optimizer_state/test_host_room.py). Each must end in one clear error before anything is
offloaded, or in a warning that says what it costs; the GPU side of the same drills is
tests/gpu/host_memory_drill.py.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_offload import HostMemoryError
from megatron_offload.core import host_memory
from megatron_offload.core.host_memory import GIB, HostSlab, describe_cost


@pytest.fixture
def pinning_refused(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """CUDA present, and cudaHostRegister answering 2 (cudaErrorMemoryAllocation) to every request."""
    calls: list[tuple[int, int]] = []

    def refuse(data_ptr: int, nbytes: int) -> int:
        calls.append((data_ptr, nbytes))
        return 2

    monkeypatch.setattr(host_memory, "_cuda_available", lambda: True)
    monkeypatch.setattr(host_memory, "_pin", refuse)
    return calls


def test_pinning_refused_falls_back_to_pageable_and_says_what_it_costs(pinning_refused: list) -> None:
    with pytest.warns(UserWarning) as caught:
        slab = HostSlab(1000, torch.float32, pin=True)
    message = str(caught[0].message)
    assert pinning_refused == [(slab.tensor.data_ptr(), 4000)] and not slab.pinned
    assert "could not pin 0.00 GiB of host memory (cudaHostRegister error 2); using pageable memory" in message
    # No GPU here, so the measurement says why it is missing; on a GPU it gives the rates (test below).
    assert "could not be measured" in message or "Measured here" in message
    assert "ulimit -l" in message and "\n" not in message
    slab.tensor.fill_(1.5)  # pageable memory works
    slab.release()  # nothing to unpin, and no error


def test_pinning_refused_can_stop_before_training_instead(pinning_refused: list) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning first: the error alone
        with pytest.raises(HostMemoryError, match=r"could not pin 0.00 GiB .*error 2\)\. Raise the locked-memory"):
            HostSlab(1000, torch.float32, pin=True, on_pin_failure="raise")


def test_the_cost_sentence_gives_both_copy_times() -> None:
    sentence = describe_cost(2 * GIB, pageable=(5.0, 4.0), pinned=(25.0, 20.0))
    assert sentence == (
        "Measured here: 5.0 GB/s to host and 4.0 GB/s back (pinned: 25.0 and 20.0), so moving 2.00 GiB out "
        "and back each step takes about 0.97 s of copying instead of 0.19 s."
    )


def test_an_allocation_the_host_refuses_is_a_clear_error() -> None:
    with pytest.raises(HostMemoryError, match=r"could not allocate 4194304.00 GiB .*the host ran short\. Free host"):
        HostSlab(1 << 50, torch.float32, pin=False)  # 4 PiB: refused at once, nothing is touched


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(mmap, "MADV_DONTFORK"), reason="needs Linux fork")
def test_a_forked_child_gets_none_of_a_slab() -> None:
    """Data-loader workers fork after the state is pinned; pinned pages would be copied into each of them,
    so the slab is left out of children altogether: reading it there faults."""
    slab = HostSlab(1 << 20, torch.uint8, pin=False)
    slab.tensor.fill_(7)
    pid = os.fork()
    if pid == 0:  # the child: touching the slab must fault
        try:
            # The fault is the point: no "Fatal Python error" dump of it (pytest turns faulthandler on).
            faulthandler.disable()
            os._exit(int(slab.tensor[4096].item()))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
    assert int(slab.tensor[4096]) == 7  # the parent keeps it


def test_the_forked_child_faults_without_a_dump() -> None:
    """The test above, in a pytest of its own, prints no fatal-error dump: a newcomer would read one as
    the suite crashing."""
    test = f"{Path(__file__).resolve()}::test_a_forked_child_gets_none_of_a_slab"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Fatal Python error" not in run.stdout + run.stderr
