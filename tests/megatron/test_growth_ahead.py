"""What the last backward learns of itself and leaves room for, without a GPU: ``growth_ahead`` bounds every
temporary from each hook to the backward's end, state coming back leaves room for them, and copies out landing
while the backward learns do not shrink what it learns. Readings are the test's (``Memory``), the handle a
ledger (``BackwardLedger``)."""

from __future__ import annotations

import torch

from megatron_offload.core.units import GIB
from megatron_offload.megatron import backward_prefetch
from megatron_offload.optimizer_state.scheduler import Peaks
from tests.megatron.test_backward_prefetch import BackwardLedger, Memory, no_retries  # noqa: F401 (the fixture)

# One last backward, hook by hook: memory held at the hook, then a temporary allocated and freed before the next.
HELD = [9 * GIB, 8 * GIB, 7 * GIB, 6 * GIB, 4 * GIB, 3 * GIB]
SPIKES = [GIB // 2, GIB // 4, 2 * GIB, GIB // 4, GIB // 2, GIB]  # after the last hook: the gradients' finalize


def test_growth_ahead_bounds_every_temporary_from_each_hook_to_the_backwards_end() -> None:
    memory, readings, highest = Memory(HELD[0]), [], []
    for held, spike in zip(HELD, SPIKES, strict=True):
        memory.set(held)
        readings.append((memory.now, memory.ever))
        memory.spike(spike)
        highest.append(held + spike)
    readings.append((memory.now, memory.ever))
    ahead = backward_prefetch.growth_ahead(readings)
    assert ahead == [max(backward_prefetch.PACING_MIN_MARGIN_BYTES, max(highest[k:]) - HELD[k]) for k in range(6)]
    assert ahead[2] == 2 * GIB and ahead[5] == GIB  # the largest temporary still ahead, over what is held there


def test_state_back_during_the_last_backward_leaves_room_for_its_temporaries(monkeypatch) -> None:
    """Learned from one last backward, the hooks of later ones bring back into what backward frees, and at no
    point of it (each hook, each temporary between two) does what is held, state included, pass the headroom,
    which going by what each hook holds alone it would."""
    memory = Memory(HELD[0]).install(monkeypatch)
    ledger = BackwardLedger(16 * GIB, step_extra=0)
    ledger.moving_chunks = lambda: [GIB // 4] * 40  # 10 GiB moving
    brought = {"bytes": 0}

    def prefetch(max_bytes: int | None = None, landed_only: bool = False) -> int:
        nbytes = min(max_bytes // (GIB // 4) * (GIB // 4), 10 * GIB - brought["bytes"])
        brought["bytes"] += nbytes
        memory.set(memory.now + nbytes)  # its blocks are allocated as the copies are queued
        return nbytes

    ledger.prefetch = prefetch
    ledger.gpu_state_bytes = lambda: brought["bytes"]  # the step's reading of what it holds leaves the state out
    ledger.scheduler.start_step()
    natural = max(held + spike for held, spike in zip(HELD, SPIKES, strict=True))  # the temporaries count in it
    ledger.scheduler.observe_step_end(Peaks(natural, natural), resident=0)
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in HELD]
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True
    headroom = ledger.scheduler.headroom()

    def iteration() -> int:
        """One backward; returns the most held at any point of it."""
        brought["bytes"], most = 0, 0
        for param, held, spike in zip(params, HELD, SPIKES, strict=True):
            memory.set(held + brought["bytes"])
            hooks.on_grad_ready(param)
            most = max(most, memory.now + spike)
            memory.spike(spike)
        hooks.on_backward_done()
        memory.set(HELD[-1] + brought["bytes"])
        hooks.on_step_start()
        hooks.new_iteration()
        return most

    assert iteration() <= headroom and iteration() <= headroom  # learning: nothing comes back
    assert brought["bytes"] == 0 and hooks.ahead is not None
    for _ in range(2):
        assert iteration() <= headroom
        assert brought["bytes"] > ledger.scheduler.room()  # more than the forward's peak leaves: what backward freed
    # Going by what each hook holds alone, the temporaries ahead would pass the headroom.
    hooks.ahead = [backward_prefetch.PACING_MIN_MARGIN_BYTES] * len(HELD)
    assert iteration() > headroom


LATE_SPIKES = [GIB // 8, GIB // 4, 5 * GIB // 2, GIB // 4, GIB // 2, GIB]  # the largest ahead of the first hook


def test_copies_out_landing_during_the_backward_that_learns_do_not_shrink_what_it_learns(monkeypatch) -> None:
    """Copies out still pending as the learning backward starts hold GPU memory that is freed as they land, in
    the middle of it; a later backward without them must not take that drop for room its temporaries leave."""
    memory = Memory(HELD[0]).install(monkeypatch)
    ledger = BackwardLedger(16 * GIB, step_extra=0)
    ledger.moving_chunks = lambda: [GIB // 4] * 40
    brought = {"bytes": 0}

    def prefetch(max_bytes: int | None = None, landed_only: bool = False) -> int:
        nbytes = min(max_bytes // (GIB // 4) * (GIB // 4), 10 * GIB - brought["bytes"])
        brought["bytes"] += nbytes
        memory.set(memory.now + nbytes)
        return nbytes

    ledger.prefetch = prefetch
    ledger.gpu_state_bytes = lambda: brought["bytes"]
    ledger.scheduler.start_step()
    natural = max(held + spike for held, spike in zip(HELD, LATE_SPIKES, strict=True))
    ledger.scheduler.observe_step_end(Peaks(natural + 2 * GIB, natural + 2 * GIB), resident=0)
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in HELD]
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True
    headroom = ledger.scheduler.headroom()

    def iteration(pending: int = 0) -> int:
        brought["bytes"], most = 0, 0
        ledger.pieces = [pending] if pending else []
        for index, (param, held, spike) in enumerate(zip(params, HELD, LATE_SPIKES, strict=True)):
            if index == 1:
                ledger.pieces = []  # the copies out landed and their blocks were freed
            memory.set(held + sum(ledger.pieces) + brought["bytes"])
            hooks.on_grad_ready(param)
            most = max(most, memory.now + spike)
            memory.spike(spike)
        hooks.on_backward_done()
        memory.set(HELD[-1] + brought["bytes"])
        hooks.on_step_start()
        hooks.new_iteration()
        return most

    iteration()  # learns the backwards per iteration
    iteration(pending=2 * GIB)  # learns with 2 GiB of copies out landing after its first hook
    assert [iteration() <= headroom for _ in range(2)] == [True, True]
    assert brought["bytes"] > 0
