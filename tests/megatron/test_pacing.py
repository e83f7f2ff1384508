"""The forward's hooks without a GPU: allocator readings and the memory limit are the test's, the
offloads a ledger the hooks drain or release. What it proves: the first forward records the profile and
lets everything land; a later forward as forecast never waits; one that starts with more copies out than
its peak has room for releases them a few at a time, each just ahead of the memory it needs, never on
the host, going between readings by the latest one and what the first iteration added since; one that grew
releases just what it needs, then offloads kept state; memory is read every few hooks, a growth seen at the
next reading, and with room to spare readings are few; hooks sit on
about SAMPLES modules and each lets the copies move.
Where some memory is in fixed-size segments, no pacing: the step's end waits, and a hook waits on the host
for the forward's whole room."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.core.units import GIB, MIB
from megatron_offload.megatron import pacing
from megatron_offload.optimizer_state.scheduler import Peaks, StateScheduler


class Ledger:
    """Stands in for OffloadHandle: offloads holding ``pieces`` bytes, freed oldest first; kept state."""

    def __init__(self, limit: int) -> None:
        self.scheduler = StateScheduler(lambda: limit)
        self.pieces: list[int] = []
        self.kept = 0
        self.drained: list[int | None] = []  # host waits
        self.released: list[int | None] = []  # the compute stream's waits
        self.evicted: list[int] = []
        self.waits = 0
        self.pumps = 0
        self.quiet = False  # what the handle said at the latest step's end
        self.under_way = True  # copies other than ``pieces`` queued or in flight (copies in): every hook pumps

    def pump(self) -> None:
        self.pumps += 1

    @property
    def idle(self) -> bool:
        return not self.pieces and not self.under_way

    def moving_chunks(self) -> list[int]:
        return [GIB] * 64

    def pending_offload_bytes(self) -> int:
        return sum(self.pieces)

    def drain_offloads(self, nbytes: int | None = None) -> None:
        self.drained.append(nbytes)
        freed = 0
        while self.pieces and (nbytes is None or freed < nbytes):
            freed += self.pieces.pop(0)

    def release_offloads(self, nbytes: int | None = None) -> int:
        self.released.append(nbytes)
        freed = 0
        while self.pieces and (nbytes is None or freed < nbytes):
            freed += self.pieces.pop(0)
        return freed

    def kept_bytes(self) -> int:
        return self.kept

    def evict(self, nbytes: int) -> int:
        self.evicted.append(nbytes)
        self.quiet = False  # as the handle's evict: its copies out move from here on
        self.under_way = True  # released or not, they are in flight until a pump sees them landed
        moved, self.kept = self.kept, 0
        self.pieces.append(moved)
        return moved

    def count_hook_wait(self) -> None:
        self.waits += 1


@pytest.fixture
def room(monkeypatch: pytest.MonkeyPatch):
    """A RoomForForward over a four-layer model on a GPU capped at 10 GiB; ``allocated`` is the reading."""
    allocated = {"bytes": 0, "peak": 0}

    def reading(peak: bool = False) -> int:
        allocated["peak"] = max(allocated["peak"], allocated["bytes"])
        return allocated["peak"] if peak else allocated["bytes"]

    monkeypatch.setattr(pacing, "allocated_bytes", reading)
    ledger = Ledger(10 * GIB)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    hooks = pacing.RoomForForward(ledger, [model])
    hooks.on_gpu = True  # the readings come from the test, not from CUDA
    return hooks, ledger, allocated, model


def forward(model: torch.nn.Module, allocated: dict, readings: list[int]) -> None:
    """Run the model's pre-hooks with the allocator reading ``readings[i]`` at hook i."""
    for layer, reading in zip(model, readings, strict=True):
        allocated["bytes"] = reading
        layer(torch.zeros(1, 2))


PROFILE = [2 * GIB, 4 * GIB, 6 * GIB, 7 * GIB]  # what the forward needs without state


def learn(hooks, ledger, allocated, model, transient: int = 0) -> None:
    """Iteration 1: the profile (``transient``: a module between hooks 1 and 2 allocates that much more
    and frees it), then the reading of the natural peak at its step's end (8 GiB reserved)."""
    for index, (layer, reading) in enumerate(zip(model, PROFILE, strict=True)):
        if index == 2 and transient:
            allocated["bytes"] = PROFILE[1] + transient
            pacing.allocated_bytes()  # the allocator's peak sees it; no hook does
        allocated["bytes"] = reading
        layer(torch.zeros(1, 2))
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(8 * GIB, 8 * GIB), resident=0)
    hooks.new_iteration()


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


def readings_in_two_iterations(limit: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Memory readings of the forward hooks over two iterations of four micro-batches, nothing leaving."""
    readings = {"n": 0, "bytes": 0}

    def reading(peak: bool = False) -> int:
        readings["n"] += not peak
        return readings["bytes"]

    monkeypatch.setattr(pacing, "allocated_bytes", reading)
    ledger = Ledger(limit)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    hooks = pacing.RoomForForward(ledger, [model])
    hooks.on_gpu = True
    learn(hooks, ledger, readings, model)
    readings["n"] = 0
    for _ in range(2):
        for _micro_batch in range(4):
            forward(model, readings, PROFILE)
        hooks.new_iteration()
    return readings["n"]


def test_with_room_for_the_forward_twice_over_memory_is_read_every_few_dozen_hooks(monkeypatch) -> None:
    # 16 hooks an iteration. The forward adds 5 GiB (2 to 7): under a 100 GiB limit the first hook after the
    # step reads and the next reading would be hook 33; under 10 GiB, hooks 1, 5, 9 and 13 read.
    assert readings_in_two_iterations(100 * GIB, monkeypatch) == 2
    assert readings_in_two_iterations(10 * GIB, monkeypatch) == 8


class Mark:
    """Stands in for a timing CUDA event: recorded at the test's clock ``now`` (ms), completed or not."""

    now = 0.0

    def __init__(self) -> None:
        self.at, self.completed = Mark.now, True

    def query(self) -> bool:
        return self.completed

    def elapsed_time(self, end: Mark) -> float:
        return end.at - self.at


def test_the_first_forward_is_timed_from_its_first_hook_to_its_last_and_the_shortest_is_kept(room) -> None:
    hooks, ledger, allocated, model = room
    marks: list[Mark] = []
    hooks.clock = lambda: marks.append(Mark()) or marks[-1]
    learn(hooks, ledger, allocated, model)
    assert marks == [] and hooks.first_forward_ms is None  # the learning forward waits for every copy: untimed
    for per_hook, completed in ((10.0, True), (6.0, True), (1.0, False), (8.0, True)):
        for _micro_batch in range(2):  # a second micro-batch's forward is not the first
            for layer in model:
                Mark.now += per_hook
                layer(torch.zeros(1, 2))
        marks[-1].completed = completed
        hooks.new_iteration()
    # Per iteration one mark at hook 1 and one at hook 4: three hooks' time of the first micro-batch.
    assert len(marks) == 8
    assert hooks.first_forward_ms == 3 * 6.0  # the 1 ms one had not completed at its step: not read


def test_without_remappable_segments_the_step_end_waits_and_a_hook_drains_for_the_whole_forward(room) -> None:
    hooks, ledger, allocated, model = room
    hooks.pace = False  # some memory in fixed-size segments: a block freed mid-forward leaves a hole
    learn(hooks, ledger, allocated, model)
    assert not hooks.paces  # so the step's end waits on the host for what the peak has no room for
    scheduler = ledger.scheduler
    headroom = scheduler.limit() - scheduler.caching_gap - scheduler.margin()
    ledger.pieces = [256 * MIB] * 12
    allocated["bytes"] = PROFILE[0] + ledger.pending_offload_bytes()
    model[0](torch.zeros(1, 2))
    # One host wait at the first hook, for room up to the forward's top, not two hooks on; nothing released.
    assert ledger.released == [] and len(ledger.drained) == 1 and ledger.drained[0] is not None
    assert PROFILE[3] + ledger.pending_offload_bytes() <= headroom


def test_hooks_sit_on_about_samples_modules_and_each_lets_the_copies_move(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pacing, "SAMPLES", 2)
    ledger = Ledger(10 * GIB)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    hooks = pacing.RoomForForward(ledger, [model])
    hooks.on_gpu = True
    assert len(hooks.hooks) == 2  # every second module with parameters of its own
    monkeypatch.setattr(pacing, "allocated_bytes", lambda peak=False: PROFILE[0])
    model(torch.zeros(1, 2))
    assert ledger.pumps == 2  # each hook is a point where copies start and land
