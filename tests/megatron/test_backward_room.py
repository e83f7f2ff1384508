"""What comes back in the last backward, near the cap: the memory backward frees stays mapped in blocks of its own
sizes, so beyond what the step leaves the forward only what the allocator can still map comes back, and a retry of
the caching allocator there (its blocks are at the cap) stops it. Without a GPU: the readings are the test's, the
handle a ledger that brings back whatever it is asked."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.core.gpu_memory import Reading
from megatron_offload.core.units import GIB
from megatron_offload.megatron import backward_prefetch
from megatron_offload.optimizer_state.scheduler import Peaks
from tests.megatron.test_backward_prefetch import Memory, Retrying


@pytest.mark.parametrize("retried", [False, True], ids=["no-retry", "retried-between-hooks"])
def test_a_retry_in_the_last_backward_stops_what_comes_back_in_it(
    monkeypatch: pytest.MonkeyPatch, retried: bool
) -> None:
    """Two hooks in the last backward, the step leaving nothing to the forward; between them backward freed
    memory. Had the allocator retried in between, nothing more comes back in that backward; the next last
    backward brings back again (one retry a backward does not limit later ones)."""
    memory = Memory(17 * GIB).install(monkeypatch)
    retries = {"count": 0}
    monkeypatch.setattr(backward_prefetch, "read_memory", lambda: Reading(memory.now, memory.now, retries["count"]))
    ledger = Retrying()
    ledger.left = 0
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(18 * GIB, 18 * GIB), resident=0)  # the forward's peak: 18 of 20 GiB
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True

    def last_backward() -> int:
        """One backward of two sampled gradients; returns how many hooks asked for state back."""
        asked = len(ledger.asked)
        memory.set(17 * GIB)  # room for a little under the limit
        hooks.on_grad_ready(first)
        retries["count"] += int(retried)
        memory.set(6 * GIB)  # backward freed 11 GiB: room for more
        hooks.on_grad_ready(second)
        memory.set(2 * GIB)
        hooks.on_backward_done()
        hooks.on_step_start()
        hooks.new_iteration()
        return len(ledger.asked) - asked

    last_backward()  # learns the backwards per iteration
    assert last_backward() == 0  # learns the growth ahead of each hook and what the step holds: nothing back
    # Each later backward asks at both hooks; after a retry between them, at the first only, and again the next time.
    assert [last_backward(), last_backward()] == ([1, 1] if retried else [2, 2])
    assert not hooks.limited


@pytest.mark.parametrize("left", [0, 4 * GIB], ids=["step-leaves-nothing", "step-leaves-4-GiB"])
def test_beyond_what_coming_back_early_is_worth_only_memory_the_allocator_can_still_map_comes_back(
    monkeypatch: pytest.MonkeyPatch, left: int
) -> None:
    """Backward freed 11 GiB between two hooks of the last backward, but the allocator keeps 18 of its 20 GiB
    mapped (in blocks of backward's sizes): what comes back at the second hook is at most what it can still map
    beside them, or what coming back early is worth where that is more (``BACK_EARLY_OVER_LEFT`` times what the
    step leaves to the next forward). Once the freed memory is unmapped (reserved follows allocated), the room
    backward freed comes back."""
    memory = Memory(17 * GIB).install(monkeypatch)
    mapped = {"bytes": 0}
    reading = lambda: Reading(memory.now, max(memory.now, mapped["bytes"]), 0)  # noqa: E731
    monkeypatch.setattr(backward_prefetch, "read_memory", reading)
    ledger = Retrying()
    ledger.left = left
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(18 * GIB, 18 * GIB), resident=0)
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True

    def last_backward(reserved: int) -> list[int]:
        """One backward of two sampled gradients, ``reserved`` mapped at the second; what each hook asked."""
        asked = len(ledger.asked)
        mapped["bytes"] = 0
        memory.set(17 * GIB)
        hooks.on_grad_ready(first)
        memory.set(6 * GIB)
        mapped["bytes"] = reserved
        hooks.on_grad_ready(second)
        memory.set(2 * GIB)
        hooks.on_backward_done()
        hooks.on_step_start()
        hooks.new_iteration()
        return ledger.asked[asked:]

    last_backward(0)
    last_backward(0)  # learning: nothing comes back
    spare = ledger.scheduler.spare(18 * GIB) - backward_prefetch.PACING_MIN_MARGIN_BYTES
    first_ask, second_ask = last_backward(18 * GIB)
    brought = min(first_ask // (GIB // 2) * (GIB // 2), 8 * GIB)
    worth = int(left * backward_prefetch.BACK_EARLY_OVER_LEFT)
    assert second_ask == max(spare, worth - brought) and (worth - brought > spare) == bool(left)
    _, unmapped_ask = last_backward(6 * GIB)
    assert unmapped_ask > 4 * GIB >= second_ask


@pytest.mark.parametrize("left", [0, 4 * GIB], ids=["step-leaves-nothing", "step-leaves-4-GiB"])
def test_with_no_room_the_allocator_can_map_the_later_hooks_of_that_backward_read_no_memory(
    monkeypatch: pytest.MonkeyPatch, left: int
) -> None:
    """The allocator holds its whole limit mapped through the last backward, as under a cap that forces most of the
    state off: where the step leaves the forward nothing, the first hook finds no room it may fill and the other
    two neither read memory nor ask (each reading is host time the GPU waits for); where it leaves 4 GiB, every
    hook reads and asks."""
    memory = Memory(17 * GIB).install(monkeypatch)
    reads = {"count": 0}

    def reading() -> Reading:
        reads["count"] += 1
        return Reading(memory.now, 20 * GIB, 0)

    monkeypatch.setattr(backward_prefetch, "read_memory", reading)
    ledger = Retrying()
    ledger.left = left
    ledger.prefetch = lambda max_bytes=None, landed_only=False: ledger.asked.append(max_bytes) or 0  # nothing lands
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(18 * GIB, 18 * GIB), resident=0)
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True

    def last_backward() -> tuple[int, int]:
        """One backward of three sampled gradients; the memory readings in it and the hooks that asked."""
        read, asked = reads["count"], len(ledger.asked)
        for now, param in zip([17 * GIB, 12 * GIB, 6 * GIB], params, strict=True):
            memory.set(now)
            hooks.on_grad_ready(param)
        in_backward = reads["count"] - read
        memory.set(2 * GIB)
        hooks.on_backward_done()
        hooks.on_step_start()
        hooks.new_iteration()
        return in_backward, len(ledger.asked) - asked

    last_backward()
    last_backward()  # learning: nothing comes back
    assert last_backward() == ((1, 0) if left == 0 else (3, 3))
