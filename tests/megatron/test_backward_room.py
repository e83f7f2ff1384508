"""What the last backward brings back where the allocator's memory is scattered: the memory backward frees stays
mapped in blocks of its own sizes, so room counted in allocated bytes may be room in no block that fits. Beyond
what the step leaves to the next forward (what coming back early is worth), the last backward brings back only
what the allocator can still map under the limit, and nothing more once it retried in that backward. Without a
GPU: the readings are the test's, the handle a ledger that brings back whatever it is asked for."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.core.units import GIB
from megatron_offload.megatron import backward_prefetch
from megatron_offload.optimizer_state.scheduler import Peaks
from tests.megatron.test_backward_prefetch import Retrying, read_from

LIMIT = 20 * GIB  # Retrying's limit; 8 GiB of state moves, the step leaves 1 GiB to the forward
ALLOCATED = 2 * GIB


def hooks_for(ledger: Retrying, params: list[torch.nn.Parameter]) -> backward_prefetch.PrefetchDuringBackward:
    """Hooks that learned: the backwards per iteration, then the margin and what the step holds."""
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True
    for _ in range(2):
        for param in params:
            hooks.on_grad_ready(param)
        hooks.on_backward_done()
        hooks.on_step_start()
        hooks.new_iteration()
    return hooks


def spare_of(ledger: Retrying, hooks: backward_prefetch.PrefetchDuringBackward, spare: int) -> int:
    """The reserved bytes that leave ``spare`` bytes to map under the limit, the margins kept free."""
    return LIMIT - ledger.scheduler.margin() - hooks.margin - spare


@pytest.mark.parametrize(
    ("spare", "brought"),
    [(None, 8 * GIB), (-GIB, GIB), (3 * GIB, 3 * GIB)],
    ids=["nothing-cached-beside-live-tensors", "no-room-to-map", "room-to-map-3-GiB"],
)
def test_beyond_what_the_step_leaves_the_forward_only_what_the_allocator_can_map_comes_back(
    monkeypatch: pytest.MonkeyPatch, spare: int | None, brought: int
) -> None:
    """Allocated bytes leave room for the whole 8 GiB. With nothing cached beside live tensors all of it comes
    back; with the memory mapped up to the limit, only the 1 GiB the step leaves to the forward; with 3 GiB
    left to map (beyond that 1 GiB), 3 GiB."""
    reserved = {"bytes": ALLOCATED}
    read_from(monkeypatch, lambda: ALLOCATED, reserved=lambda: reserved["bytes"])
    ledger, param = Retrying(), torch.nn.Parameter(torch.zeros(2))
    hooks = hooks_for(ledger, [param])
    if spare is not None:
        reserved["bytes"] = spare_of(ledger, hooks, spare)
    hooks.on_grad_ready(param)  # the last backward
    assert hooks.brought == brought
    assert not hooks.limited


@pytest.mark.parametrize("retried", [False, True], ids=["no-retry", "retried-between-hooks"])
def test_a_retry_in_the_last_backward_stops_what_comes_back_in_it(
    monkeypatch: pytest.MonkeyPatch, retried: bool
) -> None:
    """Two hooks in the last backward; between them backward freed memory the allocator unmapped, leaving room
    to map 3 GiB more. Had it retried in between, nothing more comes back in that backward; the next last
    backward brings back again (one retry a backward does not limit later ones)."""
    readings = {"reserved": ALLOCATED, "retries": 0}
    read_from(monkeypatch, lambda: ALLOCATED, lambda: readings["retries"], lambda: readings["reserved"])
    ledger = Retrying()
    ledger.left = 0  # the first forward is not timed yet: only room to map counts
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    hooks = hooks_for(ledger, [first, second])

    def last_backward() -> int:
        readings["reserved"] = spare_of(ledger, hooks, GIB)
        hooks.on_grad_ready(first)
        readings["retries"] += int(retried)
        readings["reserved"] = spare_of(ledger, hooks, 3 * GIB)  # backward freed and unmapped: 3 GiB to map
        hooks.on_grad_ready(second)
        brought = hooks.brought
        hooks.on_backward_done()
        hooks.on_step_start()
        hooks.new_iteration()
        return brought

    expected = GIB if retried else 4 * GIB
    assert [last_backward(), last_backward()] == [expected, expected]
    assert not hooks.limited
