"""The backward's hooks read once per backward what none of its hooks changes: whether it is the last
micro-batch's (megatron-core's flag, read through the model), and the room the step leaves, read again in each
backward, so that kept state that left in the forward between two backwards is seen by the next."""

from __future__ import annotations

import torch

from megatron_offload.core.units import GIB
from megatron_offload.megatron import backward_prefetch
from megatron_offload.optimizer_state.scheduler import Peaks
from tests.megatron.test_backward_prefetch import BackwardLedger, Memory


def test_each_backward_reads_the_last_micro_batch_flag_and_the_steps_room_once(monkeypatch) -> None:
    Memory(GIB).install(monkeypatch)
    ledger = BackwardLedger(10 * GIB, step_extra=0)
    ledger.moving_chunks = lambda: [GIB // 8] * 16
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)
    flag = {"last": False, "reads": 0}

    def in_last_microbatch() -> bool:
        flag["reads"] += 1
        return flag["last"]

    first, other = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], in_last_microbatch)
    hooks.on_gpu = True

    def iteration(hooks_per_backward: int = 4) -> None:
        for backward in range(2):  # two micro-batches: the second is the last
            flag["last"] = backward == 1
            hooks.on_grad_ready(first)  # the gradient that is ready first in every backward
            for _ in range(hooks_per_backward - 1):
                hooks.on_grad_ready(other)
        hooks.on_backward_done()
        hooks.on_step_start()
        hooks.new_iteration()

    for _ in range(3):  # learns the backwards per iteration, what the last backward and the step hold
        iteration()
    flag["reads"], ledger.asked = 0, []
    iteration()
    assert flag["reads"] == 1  # the last backward's four hooks read the flag once
    room = ledger.asked[0]
    ledger.kept = GIB  # kept state, as a step's decision leaves it; the next backward's room is smaller
    flag["reads"], ledger.asked = 0, []
    iteration()
    assert flag["reads"] == 1 and ledger.asked and ledger.asked[0] == room - GIB
