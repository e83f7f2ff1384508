"""The backward's hooks without a GPU: allocator readings and the memory limit are the test's, the
handle a ledger of what the hooks ask for. What it proves: what the last backward brings back leaves the
step room for all kept state (the rest of that backward room for its temporaries: test_growth_ahead.py); a
hook asks for nothing it could not bring back; once bringing state back made the allocator retry in a last
backward, later ones bring back at most what the step leaves to the forward, and a retry that state coming back
during backward did not cause (at the step's start, say) changes nothing."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.core.gpu_memory import Reading
from megatron_offload.core.units import GIB
from megatron_offload.megatron import backward_prefetch
from megatron_offload.optimizer_state.scheduler import Peaks
from tests.megatron.pacing_ledger import Ledger

RETRIES = {"count": 0}  # the stand-in allocator's retries since the process began


@pytest.fixture(autouse=True)
def no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocator never retried (no GPU here); a test that needs retries sets ``RETRIES``."""
    RETRIES["count"] = 0
    monkeypatch.setattr(backward_prefetch, "read_memory", lambda: Reading(0, 0, RETRIES["count"]))


class Memory:
    """The allocator's readings: bytes allocated now, and the running count of bytes ever allocated."""

    def __init__(self, now: int) -> None:
        self.now, self.ever = now, 0

    def set(self, now: int) -> None:
        self.ever += max(0, now - self.now)
        self.now = now

    def spike(self, nbytes: int) -> None:
        """Allocated and freed again between two readings: only the running count shows it."""
        self.ever += nbytes

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Memory:
        monkeypatch.setattr(backward_prefetch, "allocated_bytes", lambda: self.now)
        monkeypatch.setattr(backward_prefetch, "allocation_counters", lambda: (self.now, self.ever))
        monkeypatch.setattr(backward_prefetch, "read_memory", lambda: Reading(self.now, self.now, RETRIES["count"]))
        return self


class BackwardLedger(Ledger):
    """The handle as the backward's hooks see it: what they bring back, the step's own buffers, and the
    optimizer state holding GPU memory."""

    def __init__(self, limit: int, step_extra: int) -> None:
        super().__init__(limit)
        self.step_extra, self.resident, self.asked = step_extra, 0, []
        self.left = 0  # what the step leaves to the next forward's hooks (0: the first forward is not timed yet)

    def left_to_forward(self) -> int:
        return self.left

    def step_footprint(self) -> int:
        return self.step_extra

    def gpu_state_bytes(self) -> int:
        return self.resident

    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False) -> int:
        self.asked.append(max_bytes)
        return 0  # nothing had landed: the test reads what the hooks asked for


def test_the_last_backward_leaves_room_at_the_step_for_all_kept_state(monkeypatch) -> None:
    """What the last backward brings back early must leave room at the step for all kept state, or the
    step runs out of memory: in the iteration after the decision the kept state is still in host memory and
    comes back at the step's start, on top of what the step held before any was kept; from then on it
    stays, and what the step holds at its start is learned without it."""
    memory = Memory(0).install(monkeypatch)
    ledger = BackwardLedger(10 * GIB, step_extra=GIB // 2)
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)  # the peak without state
    param = torch.nn.Parameter(torch.zeros(2))
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True
    natural_at_step, kept = 2 * GIB, 3 * GIB

    def iteration(decide: int = 0) -> None:
        memory.set(GIB + ledger.resident)
        hooks.on_grad_ready(param)  # one backward per iteration: each is the last
        hooks.on_backward_done()
        memory.set(natural_at_step + ledger.resident)
        hooks.on_step_start()
        ledger.resident = ledger.kept  # the step brought the kept state back; it stays
        ledger.kept = ledger.kept or decide  # the decision, as the step ends: in host memory still
        hooks.new_iteration()

    iteration()  # learns the backwards per iteration
    iteration(decide=kept)  # learns what the backward and the step hold; the decision keeps 3 GiB
    assert ledger.asked == []  # only learning so far
    room = ledger.scheduler.backward_room(natural_at_step + ledger.step_extra + kept)
    iteration()  # the kept state comes back at this step's start
    iteration()  # and is there all through this one
    assert ledger.resident == kept and ledger.asked == [room, room]
    assert natural_at_step + ledger.step_extra + kept + room <= 10 * GIB - ledger.scheduler.margin()


@pytest.mark.parametrize("chunk_sizes", [[20 * GIB], [GIB // 4] * 2])
def test_a_backward_hook_asks_for_nothing_it_could_not_bring_back(monkeypatch, chunk_sizes) -> None:
    """Room for no chunk, or everything that left brought back already: the hook does not walk the chunks
    (it runs at every sampled gradient, in the backward's thread)."""
    Memory(GIB).install(monkeypatch)
    ledger = BackwardLedger(10 * GIB, step_extra=0)
    ledger.moving_chunks = lambda: chunk_sizes
    brought: list[int] = []

    def prefetch(max_bytes: int | None = None, landed_only: bool = False) -> int:
        ledger.asked.append(max_bytes)
        brought.append(min(max_bytes, sum(chunk_sizes) - sum(brought)))
        return brought[-1]

    ledger.prefetch = prefetch
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)
    param = torch.nn.Parameter(torch.zeros(2))
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True
    for _ in range(3):  # learn the backwards per iteration, then what the backward and the step hold
        hooks.on_grad_ready(param)
        hooks.on_backward_done()
        hooks.on_step_start()
        hooks.new_iteration()
    ledger.asked.clear()
    brought.clear()
    for _ in range(4):  # four sampled gradients in one last backward
        hooks.on_grad_ready(param)
    if chunk_sizes[0] > 10 * GIB:
        assert ledger.asked == []  # no chunk fits in any room under a 10 GiB limit
    else:
        assert len(ledger.asked) == 1 and sum(brought) == sum(chunk_sizes)  # then nothing is left to ask for


class Retrying(BackwardLedger):
    """Brings back whatever is asked, a chunk at a time, out of 8 GiB moving; the step leaves 1 GiB to the forward."""

    def __init__(self) -> None:
        super().__init__(20 * GIB, step_extra=0)
        self.left = GIB

    def moving_chunks(self) -> list[int]:
        return [GIB // 2] * 16

    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False) -> int:
        self.asked.append(max_bytes)
        return min(max_bytes // (GIB // 2) * (GIB // 2), 8 * GIB)  # one call a backward here

    def pacer(self) -> backward_prefetch.PrefetchDuringBackward:
        """Backward hooks over this ledger, the forward's peak at 4 of its 20 GiB."""
        self.scheduler.start_step()
        self.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)
        hooks = backward_prefetch.PrefetchDuringBackward(self, [torch.nn.Linear(2, 2)], lambda: True)
        hooks.on_gpu = True
        return hooks


@pytest.mark.parametrize(
    ("retries", "brings_back", "limited"),
    [([2, 2], True, True), ([1, 1], True, False), ([2, 0, 2], True, False), ([5, 5], False, False)],
    ids=["retried-twice-in-a-row", "one-retry-tolerated", "spikes-apart", "retried-with-nothing-brought"],
)
def test_retries_while_state_comes_back_limit_later_backwards_to_what_coming_back_early_is_worth(
    monkeypatch, retries: list[int], brings_back: bool, limited: bool
) -> None:
    """More than one allocator retry in each of two last backwards in a row that brought state back: from
    then on the last backward brings back at most what coming back early is worth: ``BACK_EARLY_OVER_LEFT``
    times the bytes the step leaves to the next forward (the rest comes in the step, beside its copies out), as
    they are at each iteration. One retry a backward, spikes apart, or retries with nothing brought back change
    nothing."""
    Memory(2 * GIB).install(monkeypatch)  # its readings count RETRIES
    ledger = Retrying()
    if not brings_back:
        ledger.prefetch = lambda max_bytes=None, landed_only=False: ledger.asked.append(max_bytes) or 0
    param, hooks = torch.nn.Parameter(torch.zeros(2)), ledger.pacer()  # the gradient the hooks are told of

    def iteration(retried: int = 0, at_step: int = 0) -> int:
        hooks.on_grad_ready(param)  # one backward per iteration, each the last
        RETRIES["count"] += retried  # the allocator retried during it
        hooks.on_backward_done()
        RETRIES["count"] += at_step  # state the step's start brought back made it retry: not the backward's
        hooks.on_step_start()
        brought = hooks.brought
        hooks.new_iteration()
        return brought

    iteration()
    iteration()  # learns the backwards per iteration, what the backward and the step hold
    everything = 8 * GIB if brings_back else 0
    assert [iteration(at_step=5) for _ in range(2)] == [everything] * 2 and not hooks.limited
    assert [iteration(retried=count) for count in retries] == [everything] * len(retries)  # room for all of it

    def worth(left: int) -> int:  # what the limited backward brings back, in whole chunks of half a GiB here
        return int(left * backward_prefetch.BACK_EARLY_OVER_LEFT) // (GIB // 2) * (GIB // 2)

    expected = worth(GIB) if limited else everything
    assert GIB < worth(GIB) < everything or not brings_back  # above what the step leaves to the forward
    assert [iteration() for _ in range(2)] == [expected] * 2
    ledger.left = 3 * GIB  # what the step leaves to the forward, as timed again: read at each iteration
    iteration()
    assert iteration() == (worth(3 * GIB) if limited else everything)
    assert hooks.limited is limited


def test_memory_is_read_only_in_the_last_backward_and_only_while_something_can_come_back(monkeypatch) -> None:
    """Each reading costs the backward's thread tens of microseconds: the next-to-last backward's room is the
    forward's natural peak's (no reading), and where the step leaves no room for a chunk, the last backward
    reads only at its first hook (the retries it is judged by) and what it learned before stays."""
    reads = {"count": 0, "bytes": GIB}

    def reading() -> int:
        reads["count"] += 1
        return reads["bytes"]

    monkeypatch.setattr(backward_prefetch, "allocated_bytes", reading)
    monkeypatch.setattr(backward_prefetch, "read_memory", lambda: Reading(reading(), 0, 0))
    monkeypatch.setattr(backward_prefetch, "allocation_counters", lambda: (reading(), 0))
    ledger = BackwardLedger(10 * GIB, step_extra=0)
    ledger.moving_chunks = lambda: [GIB // 4] * 4
    ledger.scheduler.start_step()
    ledger.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)
    param = torch.nn.Parameter(torch.zeros(2))
    hooks = backward_prefetch.PrefetchDuringBackward(ledger, [torch.nn.Linear(2, 2)], lambda: True)
    hooks.on_gpu = True
    first, other = param, torch.nn.Parameter(torch.zeros(2))

    def iteration(step_holds: int) -> int:
        """Two backwards (two gradients each, the first param first); returns the readings taken."""
        reads["count"] = 0
        for _ in range(2):
            for p in (first, other):
                reads["bytes"] -= GIB // 8  # the backward frees memory as it goes
                hooks.on_grad_ready(p)
            reads["bytes"] = GIB
        in_backwards = reads["count"]
        hooks.on_backward_done()
        reads["bytes"] = step_holds
        hooks.on_step_start()
        hooks.new_iteration()
        return in_backwards

    iteration(2 * GIB)  # learns the backwards per iteration
    # Learning: the last backward's two hooks read, and its first the allocator's retries; the one before none.
    assert iteration(2 * GIB) == 3
    ahead = hooks.ahead
    # Bringing back: one reading per hook of the last backward, its first also the retries it is judged by.
    assert ahead is not None and len(ahead) == 2 and iteration(2 * GIB) == 2
    hooks.at_step = 10 * GIB  # the step now holds all there is: nothing may come back ahead of it
    assert iteration(10 * GIB) == 1 and hooks.ahead == ahead  # the retries it is judged by, nothing else
