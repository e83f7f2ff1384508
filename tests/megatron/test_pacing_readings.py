"""The forward's hooks without a GPU, their readings and timing: with room to spare memory is read every few dozen
hooks; the first forward is timed from its first hook to its last, the shortest kept; where some memory is in
fixed-size segments, no pacing (the step's end waits, and a hook waits on the host for the forward's whole room);
hooks sit on about SAMPLES modules and each lets the copies move."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.core.units import GIB, MIB
from megatron_offload.megatron import pacing
from tests.megatron.pacing_ledger import PROFILE, Ledger, forward, learn


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
