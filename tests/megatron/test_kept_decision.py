"""How many bytes of optimizer state stay on the GPU: the handle decides it once, in bytes, and the
offloaders keep what it decided (to within half a chunk each), on a CPU with CUDA's peaks stood in for."""

from __future__ import annotations

import pytest
import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.config.options import OffloadConfig
from megatron_offload.core.units import GIB
from megatron_offload.megatron.optimizer_adapter import OffloadFitError, OffloadHandle
from megatron_offload.optimizer_state.scheduler import StateScheduler

LIMIT = 10 * GIB


def offloader_of(sizes: tuple[int, ...]) -> OptimizerStateOffloader:
    """fp32 masters that are the optimizer's params, planned and offloaded; Adam's moments to come."""
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    offloader = OptimizerStateOffloader(optimizer, masters, chunk_bytes=3000, pin_memory=False, check_host_memory=False)
    offloader.offload()
    return offloader


@pytest.fixture
def offloaders() -> list[OptimizerStateOffloader]:
    """Two DistributedOptimizers' worth of state, of different sizes and chunk layouts."""
    return [offloader_of((37, 1000, 5, 300, 64, 700, 1)), offloader_of((500,) * 9)]


def handle_with_room(monkeypatch: pytest.MonkeyPatch, offloaders: list, room: int, fraction) -> OffloadHandle:
    """A handle on a stand-in GPU whose forward peaks at what leaves ``room`` bytes under the limit."""
    handle = OffloadHandle(object(), OffloadConfig(fraction=fraction))
    handle.on_cuda, handle.offloaders, handle.say = True, offloaders, lambda line: None
    handle.scheduler = StateScheduler(lambda: LIMIT)
    peak = LIMIT - handle.scheduler.margin(LIMIT) - room
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: peak)
    return handle


def kept_flags(offloaders: list[OptimizerStateOffloader]) -> list[list[bool]]:
    return [[chunk.kept for chunk in offloader.chunks] for offloader in offloaders]


def test_auto_keeps_in_bytes_what_it_decided(monkeypatch: pytest.MonkeyPatch, offloaders: list) -> None:
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    for room in [0, 1, 2000, state // 3, state // 2 + 7, state - 1, state, 2 * state]:
        handle = handle_with_room(monkeypatch, offloaders, room, "auto")
        handle._before_step()
        decided = handle.scheduler.kept_budget(state)
        assert decided == min(room, state)
        shares = [offloader.kept_goal for offloader in offloaders]
        assert sum(shares) == decided  # the split loses no byte
        for offloader, share in zip(offloaders, shares, strict=True):
            half_chunk = max(max(c.nbytes, c.expected) for c in offloader.chunks) // 2
            assert abs(offloader.kept_bytes - share) <= half_chunk
            assert offloader.kept_bytes == offloader.plan.kept_bytes()
        assert handle._chosen == handle.kept_bytes() == sum(offloader.kept_bytes for offloader in offloaders)
        # What one shared fraction kept before: the same chunks.
        chosen = kept_flags(offloaders)
        for offloader in offloaders:
            offloader.set_fraction(1.0 - decided / state)
        assert kept_flags(offloaders) == chosen, room


def test_a_fixed_fraction_keeps_its_share_in_bytes_or_is_refused(monkeypatch: pytest.MonkeyPatch, offloaders) -> None:
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    for offloader in offloaders:
        offloader.set_fraction(0.4)
    by_fraction = kept_flags(offloaders)
    handle = handle_with_room(monkeypatch, offloaders, state, 0.4)
    handle._before_step()
    assert kept_flags(offloaders) == by_fraction
    assert handle._chosen == handle.kept_bytes() and abs(handle._chosen - 0.6 * state) < state / 4
    refused = handle_with_room(monkeypatch, offloaders, handle._chosen - 1, 0.4)
    with pytest.raises(OffloadFitError, match=r"^megatron-offload: --offload-fraction 0.4 keeps .* or more, or "):
        refused._before_step()
    assert refused.kept_bytes() == 0 and refused._chosen is None  # the state is whole in host memory
