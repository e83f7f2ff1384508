"""The scheduler's ledger without a GPU: made-up memory profiles in, decisions out. What it proves:
the limit is met in reserved bytes; what stays on the GPU is decided once, in whole chunks, rounded
down (never over the room), and only lowered after (the peak grew, or an eviction); uncapped with
room everything stays; a limit below the smallest footprint is told in one line with its numbers."""

from __future__ import annotations

import random

import pytest

from megatron_offload.core.units import GIB, MIB
from megatron_offload.optimizer_state.scheduler import (
    MIN_MARGIN_BYTES,
    Peaks,
    StateScheduler,
    kept_within,
    whole_chunks,
)

STATE = [[256 * MIB] * 24, [64 * MIB] * 40 + [300 * MIB]]  # two offloaders' chunks: 6 + 2.79 GiB


@pytest.fixture(autouse=True)
def no_mapped_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """No device-mapped host memory in the readings unless a test says so: on a GPU machine, weight streaming's
    tests earlier in the same process may leave theirs, which the log lines would take off."""
    from megatron_offload.core import gpu_memory

    monkeypatch.setattr(gpu_memory, "mapped_bytes", lambda: 0)
    monkeypatch.setattr(gpu_memory, "mapped_allocated_bytes", lambda: 0)


def scheduler(limit_gib: float) -> StateScheduler:
    return StateScheduler(lambda: int(limit_gib * GIB))


def after_iteration_1(limit_gib: float, natural_gib: float, allocated_gib: float | None = None) -> StateScheduler:
    """A ledger that has seen iteration 1 end (all state offloaded) at this peak."""
    ledger = scheduler(limit_gib)
    ledger.start_step()
    allocated = natural_gib if allocated_gib is None else allocated_gib
    assert not ledger.observe_step_end(Peaks(int(allocated * GIB), int(natural_gib * GIB)), resident=0)
    return ledger


def test_nothing_is_decided_before_iteration_1_has_ended() -> None:
    ledger = scheduler(26)
    assert ledger.natural is None and not ledger.decided
    assert ledger.decide(STATE) == [0, 0]  # everything moves until it has measured
    assert ledger.backlog_budget(0) == 0  # and the first step lets every offload land
    assert ledger.room() == 0


def test_the_limit_is_counted_in_reserved_bytes() -> None:
    ledger = after_iteration_1(26, natural_gib=20, allocated_gib=18)
    margin = ledger.margin()
    assert margin == int(0.03 * 26 * GIB)
    # What the reserved peak leaves, not the allocated one (2 GiB of the allocator's cache counts).
    assert ledger.room() == 26 * GIB - margin - 20 * GIB
    assert ledger.caching_gap == 2 * GIB


def test_uncapped_with_room_keeps_everything() -> None:
    ledger = after_iteration_1(80, natural_gib=30)
    assert ledger.decide(STATE) == [sum(s) for s in STATE]
    assert ledger.kept_total == sum(map(sum, STATE))
    assert ledger.backlog_budget(ledger.kept_total) > 30 * GIB  # nothing moves, nothing waits


@pytest.mark.parametrize("limit", [20.5, 21.0, 23.7, 25.0, 26.0, 29.9])
def test_the_budget_is_rounded_down_and_never_exceeds_the_room(limit: float) -> None:
    ledger = after_iteration_1(limit, natural_gib=20)
    kept = ledger.decide(STATE)
    room = ledger.room()
    assert sum(kept) <= room
    for sizes, share in zip(STATE, kept, strict=True):
        assert share == kept_within(sizes, share)  # whole chunks
    # Rounding down loses less than one chunk per offloader, unless all of it is kept.
    assert room - sum(kept) < sum(max(s) for s in STATE) or sum(kept) == sum(map(sum, STATE))


def test_whole_chunks_never_exceed_the_budget_nor_a_ceiling() -> None:
    rng = random.Random(0)
    for _ in range(500):
        sizes = [[rng.randint(1, 1000) for _ in range(rng.randint(0, 12))] for _ in range(rng.randint(1, 4))]
        budget = rng.randint(-10, sum(map(sum, sizes)) + 100)
        ceilings = [rng.randint(0, sum(s)) for s in sizes]
        for ceiling in (None, ceilings):
            shares = whole_chunks(budget, sizes, ceiling)
            assert 0 <= sum(shares) <= max(budget, 0)
            for s, share, top in zip(sizes, shares, ceiling or [sum(s) for s in sizes], strict=True):
                assert share <= top and share == kept_within(s, share)


def test_kept_bytes_only_go_down_when_the_peak_grows() -> None:
    ledger = after_iteration_1(26, natural_gib=20)
    first = ledger.decide(STATE)
    assert 0 < sum(first) <= ledger.room()
    # Iteration 2: the peak rose by no more than what was kept: no growth, nothing re-decided.
    assert not ledger.observe_step_end(Peaks(20 * GIB + sum(first), 20 * GIB + sum(first)), resident=sum(first))
    # A longer sequence: a peak beyond the natural one plus what was resident.
    grown = 20 * GIB + sum(first) + int(1.5 * GIB)
    assert ledger.observe_step_end(Peaks(grown, grown), resident=sum(first))
    assert ledger.natural == Peaks(int(21.5 * GIB), int(21.5 * GIB)) and ledger.grown == int(1.5 * GIB)
    second = ledger.decide(STATE)
    assert sum(second) <= ledger.room() and all(b <= a for a, b in zip(first, second, strict=True))
    assert "grew by 1.50 GiB" in ledger.explain(sum(map(sum, STATE)))
    # The peak falling back does not raise it again; nor does a larger limit.
    ledger._limit = lambda: 80 * GIB
    ledger.start_step()
    assert not ledger.observe_step_end(Peaks(10 * GIB, 10 * GIB), resident=0)
    assert ledger.decide(STATE) == second


def test_an_eviction_lowers_the_decision_for_good() -> None:
    ledger = after_iteration_1(80, natural_gib=30)
    everything = ledger.decide(STATE)
    ledger.lower([everything[0] - 256 * MIB, everything[1]])
    assert ledger.kept == [everything[0] - 256 * MIB, everything[1]]
    assert ledger.decide(STATE) == ledger.kept  # the room would allow more: not taken back


def test_a_fixed_share_is_a_ceiling_too() -> None:
    ledger = after_iteration_1(80, natural_gib=30)
    kept = ledger.decide(STATE, at_most=GIB)
    assert 0 < sum(kept) <= GIB
    assert ledger.decide(STATE, at_most=0) == [0, 0]


def test_the_backlog_a_step_may_leave_is_the_room_beside_kept_state() -> None:
    ledger = after_iteration_1(26, natural_gib=23)
    room = ledger.room()
    assert room == 3 * GIB - ledger.margin()
    assert ledger.backlog_budget(kept_bytes=0) == room
    assert ledger.backlog_budget(kept_bytes=GIB) == room - GIB
    assert ledger.backlog_budget(kept_bytes=room + GIB) == 0  # never negative: wait for all of it


def test_the_limit_is_read_once_per_step() -> None:
    limits = iter([26 * GIB, 20 * GIB])
    ledger = StateScheduler(lambda: next(limits))
    ledger.start_step()
    assert ledger.limit() == ledger.limit() == 26 * GIB  # the hooks read it many times: one driver call
    ledger.start_step()
    assert ledger.limit() == 20 * GIB  # another process took memory: seen at the next step


def test_backward_room_leaves_the_margin_and_the_allocator_cache() -> None:
    ledger = after_iteration_1(26, natural_gib=20, allocated_gib=19)
    assert ledger.backward_room(allocated=10 * GIB) == 26 * GIB - ledger.margin() - GIB - 10 * GIB


def test_the_headroom_follows_each_steps_limit_and_the_natural_peak_as_learned() -> None:
    """What the hooks may fill: a new limit read at the next step's start, a natural peak that grew at a step's
    end."""
    limits = iter([26 * GIB, 22 * GIB])
    ledger = StateScheduler(lambda: next(limits))
    ledger.start_step()
    ledger.observe_step_end(Peaks(19 * GIB, 20 * GIB), resident=0)
    assert ledger.headroom() == 26 * GIB - ledger.margin() - GIB
    assert ledger.observe_step_end(Peaks(19 * GIB, 21 * GIB), resident=0)  # the gap grew to 2 GiB
    assert ledger.headroom() == 26 * GIB - ledger.margin() - 2 * GIB
    ledger.start_step()  # another process took 4 GiB
    assert ledger.headroom() == 22 * GIB - ledger.margin() - 2 * GIB == ledger.backward_room(0)


def test_a_small_limit_still_keeps_the_least_margin() -> None:
    ledger = scheduler(4)
    assert ledger.margin() == MIN_MARGIN_BYTES
    ledger = after_iteration_1(4, natural_gib=4)
    assert ledger.room() == 0 and ledger.decide(STATE) == [0, 0]


def test_the_log_line_says_what_was_kept_and_why() -> None:
    ledger = after_iteration_1(26, natural_gib=20)
    ledger.decide([[GIB // 4] * 40])
    line = ledger.explain(10 * GIB)
    assert line.startswith("megatron-offload: keeps 5.00 of 10.00 GiB of optimizer state on the GPU")
    assert "moves 5.00 GiB" in line and "memory limit 26.00 GiB" in line and "peak without state 20.00" in line


def test_a_limit_below_the_smallest_footprint_is_one_line_with_the_numbers() -> None:
    ledger = scheduler(16)
    ledger.start_step()  # iteration 1's forward runs out of memory: nothing learned yet
    line = ledger.too_small(peak_reserved=int(15.5 * GIB), asked=GIB, state_bytes=int(8.18 * GIB))
    assert line == (
        "even with all 8.18 GiB of optimizer state in host memory, training needs at least 16.50 GiB without it "
        "(15.50 GiB reserved at the peak + 1.00 GiB asked) and the memory limit is 16.00 GiB"
    )


def test_the_line_counts_gpu_memory_alone_where_weights_live_in_device_mapped_host_memory(monkeypatch) -> None:
    """The allocator counts device-mapped host memory (streamed weights) as reserved, and the limit it
    enforces is the cap plus that memory: the line gives the cap and the GPU's own bytes."""
    from megatron_offload.core import gpu_memory

    mapped = 45 * GIB
    monkeypatch.setattr(gpu_memory, "mapped_bytes", lambda: mapped)
    ledger = StateScheduler(lambda: 24 * GIB + mapped)  # what memory_limit_bytes gives under a 24 GiB cap
    ledger.start_step()
    line = ledger.too_small(peak_reserved=int(6.25 * GIB), asked=192 * GIB, state_bytes=31 * GIB)
    assert line.endswith(
        "training needs at least 198.25 GiB without it (6.25 GiB reserved at the peak + "
        "192.00 GiB asked) and the memory limit is 24.00 GiB"
    )
    ledger.observe_step_end(Peaks(allocated=mapped + 14 * GIB, reserved=mapped + 16 * GIB), resident=0)
    ledger.decide([[GIB] * 31])
    assert "memory limit 24.00 GiB, peak without state 16.00 GiB reserved" in ledger.explain(31 * GIB)
