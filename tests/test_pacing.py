"""The forward's wait for copies out, without a GPU: allocator readings and the memory limit are the
test's, the copies out a ledger the hook drains. What it proves: the forward waits only when what is
allocated, plus the learned margin, would pass the limit; it waits for just enough; it learns first."""

from __future__ import annotations

import pytest
import torch

from megatron_offload import pacing

MIB = 1024**2
GIB = 1024**3


class Ledger:
    """Stands in for OffloadHandle: copies out holding ``pending`` bytes, freed oldest first in pieces."""

    def __init__(self, pieces: list[int]) -> None:
        self.offloaders: list = []
        self.pieces = list(pieces)
        self.drained: list[int | None] = []

    def pending_out_bytes(self) -> int:
        return sum(self.pieces)

    def drain_out(self, nbytes: int | None = None) -> None:
        self.drained.append(nbytes)
        freed = 0
        while self.pieces and (nbytes is None or freed < nbytes):
            freed += self.pieces.pop(0)


@pytest.fixture
def room(monkeypatch: pytest.MonkeyPatch):
    """A RoomForForward over a two-layer model, on a GPU of 10 GiB whose allocator reads ``allocated``."""
    allocated = {"bytes": 0}
    monkeypatch.setattr(pacing, "_allocated_bytes", lambda: allocated["bytes"])
    monkeypatch.setattr(pacing, "memory_limit_bytes", lambda device: 10 * GIB)
    ledger = Ledger([])
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    hooks = pacing.RoomForForward(ledger, [model])
    hooks.on_gpu = True  # the readings come from the test, not from CUDA
    return hooks, ledger, allocated, model


def forward(model: torch.nn.Module, allocated: dict, readings: list[int]) -> None:
    """Run the model's two pre-hooks with the allocator reading ``readings[i]`` at hook i."""
    for layer, reading in zip(model, readings, strict=True):
        allocated["bytes"] = reading
        layer(torch.zeros(1, 2))


def test_one_hook_for_each_module_with_parameters_of_its_own(room) -> None:
    hooks, *_ = room
    assert len(hooks.hooks) == 2  # the two Linear layers, not the Sequential around them


def test_the_first_forward_learns_and_a_later_one_waits_only_for_what_it_needs(room) -> None:
    hooks, ledger, allocated, model = room
    forward(model, allocated, [2 * GIB, 3 * GIB])  # iteration 1, nothing in flight: growth 1 GiB
    assert hooks.largest_growth == GIB and ledger.drained == []
    hooks.new_iteration()
    ledger.pieces = [512 * MIB] * 8  # 4 GiB of state leaving after the step, counted in `allocated`
    # Hook 1: 3 GiB of the forward's own + 4 GiB in flight + a 2 GiB margin = 9 GiB, under the limit.
    # Hook 2: the forward grew by 2 GiB (the margin becomes 4 GiB): 5 + 4 + 4 = 13 GiB, 3 GiB too much,
    # so the hook waits for 3 GiB of copies out to land, and no more.
    forward(model, allocated, [7 * GIB, 9 * GIB])
    assert hooks.largest_growth == 2 * GIB
    assert ledger.drained == [3 * GIB] and ledger.pending_out_bytes() == GIB


def test_with_nothing_learned_the_forward_waits_for_every_copy(room) -> None:
    hooks, ledger, allocated, model = room
    ledger.pieces = [MIB]  # still in flight before anything was learned (attach drains, so: rare)
    forward(model, allocated, [GIB, GIB])
    assert ledger.drained == [None] and hooks.waited == 1


def test_no_reading_at_all_once_learned_and_nothing_is_in_flight(room, monkeypatch: pytest.MonkeyPatch) -> None:
    hooks, ledger, allocated, model = room
    hooks.new_iteration()

    def no_reading() -> int:
        raise AssertionError("the allocator was read although no copy out is in flight")

    monkeypatch.setattr(pacing, "_allocated_bytes", no_reading)
    forward(model, allocated, [GIB, GIB])
    hooks.remove()
    assert not hooks.hooks
