"""Host room with the offloader on the CPU: the check and the way out its message names, the estimate
made before anything is pinned, a node too small for every rank, and a host that runs short once training
has started. Each must end in one clear error before anything is offloaded.
"""

from __future__ import annotations

import pytest
import torch

from megatron_offload import HostMemoryError, OptimizerStateOffloader
from megatron_offload.core import host_memory
from tests.optimizer_state.cpu_engine import adam_with_masters, take_step


def test_host_room_check_names_the_way_out() -> None:
    gib = 1024**3
    host_memory.check_host_room(4 * gib, ranks=2, available=16 * gib)
    with pytest.raises(HostMemoryError) as error:
        host_memory.check_host_room(12 * gib, ranks=2, available=16 * gib)
    message = str(error.value)
    assert "12.00 GiB" in message and "2 rank(s)" in message and "24.00 GiB" in message
    assert "--no-offload-master-weights" in message and "--no-offload-host-memory-check" in message


def test_offloader_checks_host_room_before_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer, masters = adam_with_masters()
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1000)
    with pytest.raises(HostMemoryError):
        OptimizerStateOffloader(optimizer, masters, pin_memory=False)
    # masters (4 B) + two Adam moments (8 B) per element, estimated before the moments exist
    offloader = OptimizerStateOffloader(optimizer, masters, pin_memory=False, check_host_memory=False)
    assert offloader.estimated_host_bytes() == 12 * sum(m.numel() for m in masters)


def test_available_host_bytes_reads_this_machine() -> None:
    assert 0 < host_memory.available_host_bytes() < 1 << 50


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
    assert not offloader.is_offloaded and offloader.state.host_slab is None
    assert all(torch.equal(m, b) for m, b in zip(masters, before, strict=True))  # untouched, still usable
    take_step(optimizer, 1)
