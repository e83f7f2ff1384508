"""Host-memory drills on the CPU: pinning refused, an allocation refused, a node too small for every
rank, and a host that runs short once training has started. Each must end in one clear error before
anything is offloaded, or in a warning that says what it costs; the GPU side of the same drills is
tests/gpu/host_memory_drill.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_offload import HostMemoryError, OptimizerStateOffloader
from megatron_offload.core import host_memory
from megatron_offload.core.host_memory import GIB, HostSlab, describe_cost
from tests.test_engine_cpu import adam_with_masters, take_step


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


def test_a_node_too_small_for_every_rank_stops_before_anything_is_offloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer, masters = adam_with_masters()
    per_rank = 12 * sum(m.numel() for m in masters)
    ranks = host_memory.available_host_bytes() // per_rank + 1  # this machine's real MemAvailable falls short
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    with pytest.raises(HostMemoryError) as error:
        OptimizerStateOffloader(optimizer, masters, pin_memory=False)
    message = str(error.value)
    assert f"x {ranks} rank(s) on this node" in message and "Run fewer ranks per node" in message
    assert "\n" not in message and all(m.device.type == "cpu" and m.grad is None for m in masters)


def test_a_host_that_runs_short_after_start_up_fails_before_moving_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer, masters = adam_with_masters()
    offloader = OptimizerStateOffloader(optimizer, masters, pin_memory=False)  # room at start-up
    take_step(optimizer, 0)  # Adam's moments now exist: the next offload pins a slab for them
    before = [m.detach().clone() for m in masters]
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1000)  # the host ran short meanwhile
    with pytest.raises(HostMemoryError, match="only 0.00 GiB is available"):
        offloader.offload()
    assert not offloader.is_offloaded and offloader._slab is None
    assert all(torch.equal(m, b) for m, b in zip(masters, before, strict=True))  # untouched, still usable
    take_step(optimizer, 1)
