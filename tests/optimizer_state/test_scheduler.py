"""The scheduler's ledger without a GPU: made-up memory profiles in, decisions out. What it proves:
the limit is met in reserved bytes, the backlog a step may leave is what the next forward has room
for, ``fraction="auto"`` keeps what fits and no more, and it re-chooses when the workload grows."""

from __future__ import annotations

import pytest

from megatron_offload.core.units import GIB
from megatron_offload.optimizer_state.scheduler import MIN_MARGIN_BYTES, Peaks, StateScheduler


def scheduler(limit_gib: float) -> StateScheduler:
    return StateScheduler(lambda: int(limit_gib * GIB))


def test_nothing_is_decided_before_the_first_step() -> None:
    ledger = scheduler(26)
    assert not ledger.learned
    assert ledger.kept_budget(10 * GIB) == 0  # auto offloads everything until it has measured
    assert ledger.backlog_budget(0) == 0  # and the first step lets every offload land
    assert ledger.room() == 0


def test_the_limit_is_counted_in_reserved_bytes() -> None:
    ledger = scheduler(26)
    ledger.observe_step_start(Peaks(allocated=18 * GIB, reserved=20 * GIB), on_gpu_at_peak=0)
    margin = ledger.margin()
    assert margin == int(0.03 * 26 * GIB)
    # What the reserved peak leaves, not the allocated one (2 GiB of the allocator's cache counts).
    assert ledger.room() == 26 * GIB - margin - 20 * GIB
    assert ledger.caching_gap == 2 * GIB


@pytest.mark.parametrize(
    ("limit", "natural", "state", "kept"), [(80, 30, 10, 10), (26, 20, 10, 6 - 0.78), (21, 21, 10, 0)]
)
def test_auto_keeps_what_the_limit_leaves_beside_the_peak(
    limit: float, natural: float, state: float, kept: float
) -> None:
    ledger = scheduler(limit)
    ledger.observe_step_start(Peaks(int(natural * GIB), int(natural * GIB)), on_gpu_at_peak=0)
    assert ledger.kept_budget(int(state * GIB)) == pytest.approx(kept * GIB, rel=1e-3)


def test_the_backlog_a_step_may_leave_is_the_room_beside_kept_state() -> None:
    ledger = scheduler(26)
    ledger.observe_step_start(Peaks(23 * GIB, 23 * GIB), on_gpu_at_peak=0)
    room = ledger.room()
    assert room == 3 * GIB - ledger.margin()
    assert ledger.backlog_budget(kept_bytes=0) == room
    assert ledger.backlog_budget(kept_bytes=GIB) == room - GIB
    assert ledger.backlog_budget(kept_bytes=room + GIB) == 0  # never negative: wait for all of it
    # Uncapped on a large GPU the backlog may overlap the whole forward.
    roomy = scheduler(80)
    roomy.observe_step_start(Peaks(30 * GIB, 30 * GIB), on_gpu_at_peak=0)
    assert roomy.backlog_budget(0) > 40 * GIB


def test_growth_is_seen_at_the_next_step_and_shrinks_what_is_kept() -> None:
    ledger = scheduler(26)
    ledger.observe_step_start(Peaks(20 * GIB, 20 * GIB), on_gpu_at_peak=0)
    before = ledger.kept_budget(10 * GIB)
    ledger.observe_step_end(Peaks(21 * GIB, 21 * GIB))  # the step's own peak: not growth
    assert not ledger.observe_step_start(Peaks(21 * GIB, 21 * GIB), on_gpu_at_peak=4 * GIB)
    # A longer sequence: the forward's peak passes the step's, with 4 GiB kept during it.
    assert ledger.observe_step_start(Peaks(int(25.5 * GIB), int(25.5 * GIB)), on_gpu_at_peak=4 * GIB)
    assert ledger.natural == Peaks(int(21.5 * GIB), int(21.5 * GIB))
    assert ledger.kept_budget(10 * GIB) == before - int(1.5 * GIB)
    assert "grew by 1.50 GiB" in ledger.explain(ledger.kept_budget(10 * GIB), 10 * GIB)


def test_the_limit_is_read_once_per_step() -> None:
    limits = iter([26 * GIB, 20 * GIB])
    ledger = StateScheduler(lambda: next(limits))
    ledger.observe_step_start(Peaks(10 * GIB, 10 * GIB), on_gpu_at_peak=0)
    assert ledger.limit() == ledger.limit() == 26 * GIB  # the hooks read it many times: one driver call
    ledger.observe_step_start(Peaks(10 * GIB, 10 * GIB), on_gpu_at_peak=0)
    assert ledger.limit() == 20 * GIB  # another process took memory: seen at the next step


def test_backward_room_leaves_the_margin_and_the_allocator_cache() -> None:
    ledger = scheduler(26)
    ledger.observe_step_start(Peaks(19 * GIB, 20 * GIB), on_gpu_at_peak=0)
    assert ledger.backward_room(allocated=10 * GIB) == 26 * GIB - ledger.margin() - GIB - 10 * GIB


def test_a_small_limit_still_keeps_the_least_margin() -> None:
    ledger = scheduler(4)
    assert ledger.margin() == MIN_MARGIN_BYTES
    ledger.observe_step_start(Peaks(4 * GIB, 4 * GIB), on_gpu_at_peak=0)
    assert ledger.room() == 0 and ledger.kept_budget(GIB) == 0


def test_the_log_line_says_what_was_chosen_and_why() -> None:
    ledger = scheduler(26)
    ledger.observe_step_start(Peaks(20 * GIB, 20 * GIB), on_gpu_at_peak=0)
    line = ledger.explain(int(5.22 * GIB), 10 * GIB)
    assert line.startswith("megatron-offload: --offload-fraction auto keeps 5.22 of 10.00 GiB")
    assert "offloads 4.78 GiB" in line and "memory limit 26.00 GiB" in line and "peak without state 20.00" in line
