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


class LastBackwards:
    """Last backwards over ``HELD`` with ``spikes`` (a temporary after each hook), whose hooks bring back 1/4 GiB
    chunks (10 GiB moving; their blocks allocated as the copies are queued), under a 16 GiB limit; the forward's
    natural peak ``above`` the backward's highest point."""

    def __init__(self, monkeypatch, spikes: list[int], above: int = 0) -> None:
        self.memory, self.spikes, self.brought = Memory(HELD[0]).install(monkeypatch), spikes, 0
        self.ledger = BackwardLedger(16 * GIB, step_extra=0)
        self.ledger.moving_chunks = lambda: [GIB // 4] * 40
        self.ledger.prefetch = self.prefetch
        self.ledger.gpu_state_bytes = lambda: self.brought  # the step's reading of what it holds leaves it out
        self.ledger.scheduler.start_step()
        natural = max(held + spike for held, spike in zip(HELD, spikes, strict=True)) + above  # temporaries count
        self.ledger.scheduler.observe_step_end(Peaks(natural, natural), resident=0)
        self.params = [torch.nn.Parameter(torch.zeros(2)) for _ in HELD]
        self.hooks = backward_prefetch.PrefetchDuringBackward(self.ledger, [torch.nn.Linear(2, 2)], lambda: True)
        self.hooks.on_gpu = True
        self.headroom = self.ledger.scheduler.headroom()

    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False, now: bool = False) -> int:
        nbytes = min(max_bytes // (GIB // 4) * (GIB // 4), 10 * GIB - self.brought)
        self.brought += nbytes
        self.memory.set(self.memory.now + nbytes)
        return nbytes

    def run(self, pending: int = 0) -> int:
        """One iteration's last backward and step; ``pending``: bytes of copies out that land after the first
        hook. Returns the most held at any point of the backward."""
        self.brought, most = 0, 0
        self.ledger.pieces = [pending] if pending else []
        for index, (param, held, spike) in enumerate(zip(self.params, HELD, self.spikes, strict=True)):
            if index == 1:
                self.ledger.pieces = []  # the copies out landed and their blocks were freed
            self.memory.set(held + sum(self.ledger.pieces) + self.brought)
            self.hooks.on_grad_ready(param)
            most = max(most, self.memory.now + spike)
            self.memory.spike(spike)
        self.hooks.on_backward_done()
        self.memory.set(HELD[-1] + self.brought)
        self.hooks.on_step_start()
        self.hooks.new_iteration()
        return most


def test_state_back_during_the_last_backward_leaves_room_for_its_temporaries(monkeypatch) -> None:
    """Learned from one last backward, the hooks of later ones bring back into what backward frees, and at no
    point of it (each hook, each temporary between two) does what is held, state included, pass the headroom,
    which going by what each hook holds alone it would."""
    backwards = LastBackwards(monkeypatch, SPIKES)
    headroom = backwards.headroom
    assert backwards.run() <= headroom and backwards.run() <= headroom  # learning: nothing comes back
    assert backwards.brought == 0 and backwards.hooks.ahead is not None
    for _ in range(2):
        assert backwards.run() <= headroom
        assert backwards.brought > backwards.ledger.scheduler.room()  # more than the forward's peak leaves
    # Going by what each hook holds alone, the temporaries ahead would pass the headroom.
    backwards.hooks.ahead = [backward_prefetch.PACING_MIN_MARGIN_BYTES] * len(HELD)
    assert backwards.run() > headroom


LATE_SPIKES = [GIB // 8, GIB // 4, 5 * GIB // 2, GIB // 4, GIB // 2, GIB]  # the largest ahead of the first hook


def test_copies_out_landing_during_the_backward_that_learns_do_not_shrink_what_it_learns(monkeypatch) -> None:
    """Copies out still pending as the learning backward starts hold GPU memory that is freed as they land, in
    the middle of it; a later backward without them must not take that drop for room its temporaries leave."""
    backwards = LastBackwards(monkeypatch, LATE_SPIKES, above=2 * GIB)
    backwards.run()  # learns the backwards per iteration
    backwards.run(pending=2 * GIB)  # learns with 2 GiB of copies out landing after its first hook
    assert [backwards.run() <= backwards.headroom for _ in range(2)] == [True, True]
    assert backwards.brought > 0
