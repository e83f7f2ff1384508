"""With nothing moving (the whole state kept) and no copy under way, the training loop's hooks have nothing
to do between the forward's memory readings: the handle says so after each step, and the hooks return at
once until a reading is due, the readings where they were; so do a forward's hooks whenever no copy is queued
or in flight (the later forwards, state moving). What it proves, on a CPU: the handle says it only
when no chunk moves and every copy queue is idle; a quiet forward pumps only at its readings and its last
hook, and reads as often as before; a growth seen at a reading evicts kept state and every later hook pumps
its copies out again; a quiet backward's hooks neither pump nor count."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.config.options import OffloadConfig
from megatron_offload.core.gpu_memory import Reading
from megatron_offload.core.units import GIB
from megatron_offload.megatron import backward_prefetch, pacing
from megatron_offload.megatron.optimizer_adapter import OffloadHandle
from tests.megatron.pacing_ledger import PROFILE, Ledger, learn
from tests.megatron.test_backward_prefetch import BackwardLedger
from tests.megatron.test_kept_decision import offloader_of


def test_the_handle_says_quiet_only_when_no_chunk_moves_and_no_copy_is_under_way() -> None:
    offloaders = [offloader_of((37, 1000, 5, 300, 64, 700, 1)), offloader_of((500,) * 9)]
    handle = OffloadHandle(object(), OffloadConfig())
    handle.offloaders = offloaders  # no CUDA here: the step wrapper's decision and pacing are skipped
    step = handle._step_wrapper(lambda: None)
    said = []
    step()  # every chunk offloaded: they move every iteration
    said.append(handle.quiet)
    for offloader in offloaders:
        offloader.keep_bytes(offloader.plan.full_bytes())  # every chunk kept
        offloader.prefetch()  # and on its way back: a copy under way
    assert not handle.idle
    step()
    said.append(handle.quiet)
    for offloader in offloaders:
        offloader.copies.drain()  # landed
    step()
    said.append(handle.quiet)
    assert said == [False, False, True] and handle.idle
    assert handle.evict(1) > 0 and not handle.quiet  # kept state leaves: the forward's and backward's hooks pump


@pytest.fixture
def readings(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    allocated = {"bytes": 0, "n": 0}

    def reading(peak: bool = False) -> int:
        allocated["n"] += not peak
        return allocated["bytes"]

    monkeypatch.setattr(pacing, "allocated_bytes", reading)
    return allocated


def forward_after_a_step(
    quiet: bool, readings: dict, kept: int = GIB, grown: int = 0, under_way: bool | None = None, leaving: int = 0
) -> Ledger:
    """A forward of four hooks, as learned (``grown`` more from hook 1 on), after a step that said ``quiet``;
    ``under_way``: copies in queued or in flight (by default unless quiet), ``leaving``: bytes of copies out."""
    ledger = Ledger(10 * GIB)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    hooks = pacing.RoomForForward(ledger, [model])
    hooks.on_gpu = True
    learn(hooks, ledger, readings, model)
    ledger.kept = kept
    hooks.new_iteration()
    ledger.quiet = quiet  # what the handle said at the step's end
    ledger.under_way = not quiet if under_way is None else under_way
    ledger.pieces = [leaving] if leaving else []
    ledger.pumps = readings["n"] = 0
    for layer, natural in zip(model, PROFILE, strict=True):
        readings["bytes"] = natural + grown + ledger.kept
        layer(torch.zeros(1, 2))
    return ledger


def test_a_quiet_forward_pumps_only_where_it_reads_and_at_its_last_hook(readings) -> None:
    busy = forward_after_a_step(False, readings)
    busy_readings = readings["n"]
    quiet = forward_after_a_step(True, readings)
    assert busy.pumps == 4 and quiet.pumps == 2  # hook 1 (the reading after the step) and hook 4 (the last)
    assert readings["n"] == busy_readings == 1  # the readings where they were
    assert quiet.evicted == [] and quiet.released == [] and quiet.drained == []


def test_a_forward_with_state_moving_but_no_copy_under_way_pumps_only_where_it_reads(readings) -> None:
    """The later forwards of an iteration: the state moves every step, but the copies out the step left have
    landed and none comes back yet; their hooks between readings return at once, a copy pending makes them pump."""
    idle = forward_after_a_step(False, readings, under_way=False)
    assert idle.pumps == 2 and readings["n"] == 1  # hook 1 (reading) and hook 4 (the last), the reading kept
    coming = forward_after_a_step(False, readings, under_way=True)
    leaving = forward_after_a_step(False, readings, under_way=False, leaving=64 * 1024 * 1024)
    assert coming.pumps == leaving.pumps == 4


def test_a_growth_read_in_a_quiet_forward_evicts_and_every_later_hook_pumps_again(readings) -> None:
    ledger = forward_after_a_step(True, readings, grown=4 * GIB)
    assert ledger.evicted and ledger.kept == 0 and not ledger.quiet  # seen at hook 1: kept state leaves
    assert ledger.pumps == 4  # hooks 2 and 3 pump its copies out too
    assert ledger.drained == []  # never a host wait


def test_a_quiet_backward_neither_pumps_nor_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backward_prefetch, "read_memory", lambda: Reading(GIB, GIB, 0))  # no GPU here
    monkeypatch.setattr(backward_prefetch, "allocated_bytes", lambda: GIB)
    monkeypatch.setattr(backward_prefetch, "allocation_counters", lambda: (GIB, GIB))
    ledger = BackwardLedger(10 * GIB, step_extra=0)
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True
    param = torch.nn.Parameter(torch.zeros(2))
    hooks.on_grad_ready(param)  # iteration 1: every chunk moves
    hooks.new_iteration()
    assert ledger.pumps == 1 and hooks.backwards_per_iteration == 1
    hooks.new_iteration()
    ledger.quiet = True
    hooks.on_grad_ready(param)
    assert ledger.pumps == 1 and hooks.backwards == 0
    hooks.new_iteration()
    ledger.evict(0)  # something moves again (a forward evicted): every hook pumps and counts
    hooks.on_grad_ready(param)
    assert ledger.pumps == 2 and hooks.backwards == 1
