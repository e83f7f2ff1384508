"""The forward's hooks without a GPU: allocator readings and the memory limit are the test's, the
offloads a ledger the hooks drain or release (``pacing_ledger.py``). What it proves: the first forward records the
profile and lets everything land; a later forward as forecast never waits; one that starts with more copies out than
its peak has room for releases them a few at a time, each just ahead of the memory it needs, never on
the host, going between readings by the latest one and what the first iteration added since; one that grew
releases just what it needs, then offloads kept state; a growth is seen at the next reading."""

from __future__ import annotations

import torch

from megatron_offload.core.units import GIB, MIB
from megatron_offload.megatron import pacing
from tests.megatron.pacing_ledger import PROFILE, forward, learn


def test_one_hook_for_each_module_with_parameters_of_its_own(room) -> None:
    hooks, *_ = room
    assert len(hooks.hooks) == 4  # the Linear layers, not the Sequential around them


def test_the_first_forward_records_the_profile_and_lets_everything_land(room) -> None:
    hooks, ledger, allocated, model = room
    ledger.pieces = [256 * MIB] * 2
    forward(model, allocated, [p + 512 * MIB for p in PROFILE])
    assert ledger.drained == [None] and ledger.waits == 1
    assert hooks.profile == [PROFILE[0], PROFILE[1] + 512 * MIB, PROFILE[2] + 512 * MIB, PROFILE[3] + 512 * MIB]


def test_a_forward_as_forecast_never_waits(room) -> None:
    hooks, ledger, allocated, model = room
    learn(hooks, ledger, allocated, model)
    backlog = ledger.scheduler.backlog_budget(0)  # what the step is allowed to leave
    assert backlog > 0
    ledger.pieces = [backlog]
    forward(model, allocated, [p + backlog for p in PROFILE])
    assert ledger.drained == [] and ledger.released == [] and ledger.waits == 0


def test_copies_out_beyond_the_peak_room_are_released_just_ahead_of_the_memory_the_forward_needs(room) -> None:
    hooks, ledger, allocated, model = room
    learn(hooks, ledger, allocated, model)
    scheduler = ledger.scheduler
    headroom = scheduler.limit() - scheduler.caching_gap - scheduler.margin()
    ledger.pieces = [256 * MIB] * 12  # 3 GiB out, more than the peak leaves room for (backlog_budget)
    assert ledger.pending_offload_bytes() > scheduler.backlog_budget(0)
    for index, layer in enumerate(model):
        allocated["bytes"] = PROFILE[index] + ledger.pending_offload_bytes()  # copies out still hold memory
        layer(torch.zeros(1, 2))
        # After the hook: what the forward holds and adds before two hooks on (at the top: up to the
        # natural peak of 8 GiB) fits, with the copies still out.
        ahead = (PROFILE[min(index + pacing.LOOKAHEAD, 3)] if index < 3 else 8 * GIB) - PROFILE[index]
        assert PROFILE[index] + ledger.pending_offload_bytes() + ahead <= headroom
    assert ledger.drained == [] and ledger.evicted == []  # never a host wait, nothing kept lost
    assert ledger.released[0] is not None and len(ledger.released) == 2  # a few at a time, not all at once
    assert 0 < ledger.pending_offload_bytes() <= scheduler.backlog_budget(0)  # the rest lands beside the peak


def test_what_a_module_allocates_and_frees_between_hooks_is_made_room_for_too(room) -> None:
    hooks, ledger, allocated, model = room
    learn(hooks, ledger, allocated, model, transient=3 * GIB)  # 7 GiB for a moment between hooks 1 and 2
    scheduler = ledger.scheduler
    headroom = scheduler.limit() - scheduler.caching_gap - scheduler.margin()
    ledger.pieces = [256 * MIB] * 12
    allocated["bytes"] = PROFILE[0] + ledger.pending_offload_bytes()
    model[0](torch.zeros(1, 2))
    # By hook 2 the forward will have held 7 GiB for a moment: the copies out that would not fit beside it go now.
    assert ledger.released and PROFILE[1] + 3 * GIB + ledger.pending_offload_bytes() <= headroom


def test_a_forward_that_grew_waits_for_just_what_it_needs_then_evicts(room, monkeypatch) -> None:
    hooks, ledger, allocated, model = room
    monkeypatch.setattr(pacing, "READ_EVERY", 1)  # every hook reads: the growth is seen where it happens
    learn(hooks, ledger, allocated, model)
    scheduler = ledger.scheduler
    ledger.pieces = [128 * MIB] * 8  # 1 GiB pending
    ledger.kept = GIB
    # At hook 1 the rest of the forward adds what it added in the first one (3 GiB): a reading that far
    # above the profile must free exactly what would pass the limit.
    slack = scheduler.limit() - scheduler.margin() - scheduler.caching_gap - PROFILE[3]
    over = 384 * MIB
    for layer, reading in zip(model[:2], [PROFILE[0], PROFILE[1] + slack + over], strict=True):
        allocated["bytes"] = reading
        layer(torch.zeros(1, 2))
    assert ledger.released == [over] and ledger.drained == []  # the oldest copies out, as many as the excess
    assert ledger.evicted == []
    allocated["bytes"] = PROFILE[2] + slack + 2 * GIB  # more than all that is pending: kept state must go
    model[2](torch.zeros(1, 2))
    assert ledger.evicted and ledger.kept == 0 and ledger.released[-1] is None and ledger.drained == []


def test_with_nothing_leaving_a_forward_that_grew_is_seen_at_the_next_reading(room, monkeypatch) -> None:
    hooks, ledger, allocated, model = room
    monkeypatch.setattr(pacing, "READ_EVERY", 2)
    learn(hooks, ledger, allocated, model)
    ledger.kept = GIB  # nothing leaving: hooks 1 and 3 read
    grown = 3 * GIB  # from hook 2 on the forward holds 3 GiB more than its profile: more than all it may hold
    for index, layer in enumerate(model[:3]):
        allocated["bytes"] = PROFILE[index] + (grown if index else 0) + ledger.kept
        layer(torch.zeros(1, 2))
        if index == 1:  # hook 2 did not read: the growth is not seen yet
            assert ledger.evicted == [] and ledger.kept == GIB
    assert ledger.evicted and ledger.kept == 0  # hook 3 read it: kept state went, and its copy out was released
    assert ledger.released[-1] is None and ledger.drained == []


def test_between_readings_copies_out_are_paced_by_the_last_reading_and_the_first_iteration(room, monkeypatch) -> None:
    hooks, ledger, allocated, model = room
    reads = {"n": 0}
    reading = pacing.allocated_bytes

    def counted(peak: bool = False) -> int:
        reads["n"] += not peak
        return reading(peak)

    monkeypatch.setattr(pacing, "allocated_bytes", counted)
    monkeypatch.setattr(pacing, "READ_EVERY", 2)
    learn(hooks, ledger, allocated, model)
    scheduler = ledger.scheduler
    headroom = scheduler.limit() - scheduler.caching_gap - scheduler.margin()
    ledger.pieces = [256 * MIB] * 12  # 3 GiB out, more than the peak leaves room for
    reads["n"] = 0
    for index, layer in enumerate(model[:2]):  # as the first iteration: hook 1 reads, hook 2 goes by it
        allocated["bytes"] = PROFILE[index] + ledger.pending_offload_bytes()
        layer(torch.zeros(1, 2))
        ahead = PROFILE[min(index + pacing.LOOKAHEAD, 3)] - PROFILE[index]
        assert PROFILE[index] + ledger.pending_offload_bytes() + ahead <= headroom  # paced as if read
    assert reads["n"] == 1 and ledger.released and None not in ledger.released and ledger.drained == []
    # From hook 3 on the forward holds 2 GiB more than the first one did, and more than all still pending: the
    # reading at hook 3 sees it, gives back every copy out and sends the kept state out after them.
    ledger.kept = GIB
    allocated["bytes"] = PROFILE[2] + 2 * GIB + ledger.pending_offload_bytes() + ledger.kept
    model[2](torch.zeros(1, 2))
    assert reads["n"] == 2 and ledger.evicted and ledger.released[-1] is None and ledger.drained == []
