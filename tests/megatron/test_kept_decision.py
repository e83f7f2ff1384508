"""How many bytes of optimizer state stay on the GPU: the scheduler decides it once, in bytes, when
iteration 2's step has ended (the first to stream the whole state), whole chunks rounded down, and
only lowers it after; the offloaders keep exactly what it decided. On a CPU with CUDA's peaks stood in for."""

from __future__ import annotations

import pytest
import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.config.options import OffloadConfig
from megatron_offload.core.units import GIB
from megatron_offload.megatron import finalize_prefetch, offload_handle
from megatron_offload.megatron.kept_decision import LEARNING_STEPS
from megatron_offload.megatron.optimizer_adapter import OffloadFitError, OffloadHandle
from megatron_offload.megatron.pacing import RoomForForward
from megatron_offload.optimizer_state.scheduler import StateScheduler, kept_chunks

LIMIT = 10 * GIB


def offloader_of(sizes: tuple[int, ...]) -> OptimizerStateOffloader:
    """fp32 masters that are the optimizer's params, planned and offloaded; Adam's moments to come."""
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    offloader = OptimizerStateOffloader(optimizer, masters, chunk_bytes=3000, pin_memory=False, check_host_memory=False)
    offloader.offload()
    return offloader


@pytest.fixture
def offloaders() -> list[OptimizerStateOffloader]:
    """Two DistributedOptimizers' worth of state, of different sizes and chunk layouts."""
    return [offloader_of((37, 1000, 5, 300, 64, 700, 1)), offloader_of((500,) * 9)]


def handle_with_room(
    monkeypatch: pytest.MonkeyPatch, offloaders: list, room: int, fraction="auto", prefetch="auto"
) -> OffloadHandle:
    """A handle on a stand-in GPU whose first iterations peaked at what leaves ``room`` bytes under the limit."""
    handle = OffloadHandle(object(), OffloadConfig(fraction=fraction, prefetch=prefetch))
    handle.on_cuda, handle.offloaders, handle.say = True, offloaders, handle_lines.append
    handle.decision.scheduler = StateScheduler(lambda: LIMIT)
    peak = LIMIT - handle.scheduler.margin(LIMIT) - room
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: peak)
    retries.clear()
    monkeypatch.setattr(offload_handle, "allocator_retries", lambda: len(retries))  # the allocator's counter
    return handle


handle_lines: list[str] = []
retries: list[int] = []  # one entry per retry of the stand-in allocator since the process began


def iteration(handle: OffloadHandle) -> None:
    """What the step wrapper calls around a step that succeeded (no CUDA: the peaks are stood in for);
    the first call runs the steps the decision waits for."""
    handle.backward_done()
    handle._after_step(stepped=True)
    while handle.decision.steps < LEARNING_STEPS:
        handle.backward_done()
        handle._after_step(stepped=True)


def kept_flags(offloaders: list[OptimizerStateOffloader]) -> list[list[bool]]:
    return [[chunk.kept for chunk in offloader.chunks] for offloader in offloaders]


def test_the_default_keeps_whole_chunks_within_the_room(monkeypatch: pytest.MonkeyPatch, offloaders: list) -> None:
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    for room in [0, 1, 2000, state // 3, state // 2 + 7, state - 1, state, 2 * state]:
        for offloader in offloaders:
            offloader.keep_bytes(0)
        handle = handle_with_room(monkeypatch, offloaders, room)
        iteration(handle)
        decided = handle.scheduler.kept
        assert decided == [offloader.kept_bytes for offloader in offloaders]
        assert handle.kept_bytes() == sum(decided) <= min(room, state)  # rounded down, never over
        biggest = max(size for offloader in offloaders for size in offloader.full_sizes())
        assert min(room, state) - sum(decided) < len(offloaders) * biggest
        for offloader, flags, share in zip(offloaders, kept_flags(offloaders), decided, strict=True):
            # Whole chunks from the back: each one passed over is larger than what its share had left.
            assert {i for i, kept in enumerate(flags) if kept} == kept_chunks(offloader.full_sizes(), share)
    assert handle.kept_bytes() == state  # with room to spare, everything stays: nothing moves
    assert handle_lines[-1].startswith("megatron-offload: keeps ")


def test_the_decision_is_made_once_and_only_lowered(monkeypatch: pytest.MonkeyPatch, offloaders: list) -> None:
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    handle = handle_with_room(monkeypatch, offloaders, state // 2)
    iteration(handle)
    first = handle.kept_bytes()
    assert 0 < first <= state // 2
    iteration(handle)  # the same peak again: nothing changes
    assert handle.kept_bytes() == first
    handle.evict(1)  # a forward ran short: the front of the kept run leaves, for good
    lowered = handle.kept_bytes()
    assert lowered < first and handle.scheduler.kept_total == lowered
    iteration(handle)
    assert handle.kept_bytes() == lowered
    # The peak grows by more than what was resident: the decision shrinks.
    grown = LIMIT - handle.scheduler.margin(LIMIT) - state // 2 + lowered + state // 4
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: grown)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: grown)
    iteration(handle)
    assert handle.kept_bytes() <= handle.scheduler.room() < lowered


def test_allocator_retries_are_reported_and_leave_the_decision(monkeypatch: pytest.MonkeyPatch, offloaders) -> None:
    """The log line counts the caching allocator's retries under the limit; what stays is decided by the
    peaks alone (keeping less on retries cost more link time than the retries did)."""
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    handle = handle_with_room(monkeypatch, offloaders, state // 2)
    iteration(handle)
    first = handle.kept_bytes()
    assert first > 0 and handle.read_stats().allocator_retries == 0
    retries.extend([1, 1, 1])  # this iteration's allocator ran short three times
    iteration(handle)
    assert handle.read_stats().allocator_retries == 3 and handle.kept_bytes() == first


def test_step_keeps_nothing(monkeypatch: pytest.MonkeyPatch, offloaders: list) -> None:
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    handle = handle_with_room(monkeypatch, offloaders, 2 * state, prefetch="step")
    iteration(handle)
    assert handle.kept_bytes() == 0 and not any(any(flags) for flags in kept_flags(offloaders))


def test_a_fixed_fraction_keeps_its_share_in_bytes_or_is_refused(monkeypatch: pytest.MonkeyPatch, offloaders) -> None:
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    handle = handle_with_room(monkeypatch, offloaders, state, 0.4)
    iteration(handle)
    kept = handle.kept_bytes()
    assert kept <= 0.6 * state and abs(kept - 0.6 * state) < state / 4
    for offloader in offloaders:
        offloader.keep_bytes(0)
    refused = handle_with_room(monkeypatch, offloaders, kept - 1, 0.4)
    for _ in range(LEARNING_STEPS - 1):
        refused.backward_done()
        refused._after_step(stepped=True)
    refused.backward_done()
    with pytest.raises(OffloadFitError, match=r"^megatron-offload: --offload-fraction 0.4 keeps .* or more, or "):
        refused._after_step(stepped=True)
    assert refused.kept_bytes() == 0 and refused.scheduler.kept is None  # the state is whole in host memory


def test_the_decision_waits_for_the_first_step_that_streams_the_whole_state(
    monkeypatch: pytest.MonkeyPatch, offloaders: list
) -> None:
    """Iteration 1's step makes Adam's moments and streams only the masters: its peak is below every later
    step's. Nothing is kept until iteration 2's step has ended, and what is kept then fits beside its peak."""
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    handle = handle_with_room(monkeypatch, offloaders, state)  # iteration 1 leaves room for all of it
    handle.backward_done()
    handle._after_step(stepped=True)
    assert handle.scheduler.kept is None and handle.kept_bytes() == 0  # whole in host memory still
    later = LIMIT - handle.scheduler.margin(LIMIT) - state // 3  # iteration 2 streams the whole state
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: later)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: later)
    handle.backward_done()
    handle._after_step(stepped=True)
    assert 0 < handle.kept_bytes() == handle.scheduler.kept_total <= state // 3


def test_the_step_leaves_the_next_forward_what_the_link_carries_in_its_first_forward(offloaders) -> None:
    handle = OffloadHandle(object(), OffloadConfig())
    handle.offloaders = offloaders
    handle._room = room = RoomForForward(handle, [torch.nn.Linear(2, 2)])
    offloaders[0].stats.bytes_offloaded, offloaders[0].stats.offload_seconds = 30 * GIB, 0.5
    offloaders[1].stats.bytes_offloaded, offloaders[1].stats.offload_seconds = 10 * GIB, 0.5
    assert handle.forward_hides() == 0  # no forward timed yet: every copy out starts within the step
    room.first_forward_ms = 50.0
    link = 40 * GIB / 1.0  # both offloaders' bytes over their copies' time
    assert handle.forward_hides() == int(link * 0.050) // 2  # the whole forward's, shared by the two
    for offloader in offloaders:
        offloader.stats.offload_seconds = 0.0
    assert handle.forward_hides() == 0  # no copy out timed yet


@pytest.mark.parametrize("prefetch", ["auto", "step"])
def test_what_moves_starts_back_as_the_step_begins_within_its_room(
    monkeypatch: pytest.MonkeyPatch, offloaders: list, prefetch: str
) -> None:
    """Once what stays is decided, the default starts back at the step's start the chunks still in host memory,
    whole and in step order, that fit in what the limit leaves beside what is allocated and the step's buffers;
    the backward's hooks have read their retries first (those are the backward's). ``step`` (the smallest
    footprint) brings nothing back."""
    state = sum(offloader.plan.full_bytes() for offloader in offloaders)
    handle = handle_with_room(monkeypatch, offloaders, room=state // 3, prefetch=prefetch)
    iteration(handle)  # the decision: a third of the state stays, the rest moves
    for offloader in offloaders:  # all of it in host memory, as after iteration 2's step
        offloader.offload()
        offloader.copies.drain()
    seen = []

    class Backward:  # the backward's hooks, as the handle sees them
        brought = 0

        def on_backward_done(self) -> None:
            seen.append(sum(offloader.gpu_state_bytes for offloader in offloaders))

        def new_iteration(self) -> None: ...

    handle._pacer = Backward()
    moving = [chunk.nbytes for offloader in offloaders for chunk in offloader.chunks if not chunk.kept]
    # The kept state is in host memory too: the step brings it back first, so the room leaves it out.
    kept_away = sum(offloader.kept_to_come_back for offloader in offloaders)
    assert kept_away == handle.kept_bytes() and (kept_away > 0) == (prefetch == "auto")  # `step` keeps none
    allocated = handle.scheduler.backward_room(handle.step_footprint()) - kept_away - sum(moving) // 2  # about half
    monkeypatch.setattr(finalize_prefetch, "allocated_bytes", lambda: allocated)
    room = handle.scheduler.backward_room(allocated + handle.step_footprint() + kept_away)
    before = sum(offloader.gpu_state_bytes for offloader in offloaders)
    handle.backward_done()
    assert seen == [before]  # the retries were read before anything came back
    if prefetch == "step":
        assert handle.brought_at_step == 0
        return
    assert 0 < room < sum(moving), (room, moving)  # room for some of it, not all
    expected = 0  # whole chunks in step order, up to the room (the kept ones, at the back, come back in the step)
    for offloader in offloaders:
        for chunk in offloader.chunks:
            if expected + chunk.nbytes > room:
                break
            expected += chunk.nbytes
    assert handle.brought_at_step == expected > 0
    assert sum(offloader.gpu_state_bytes for offloader in offloaders) == before + expected


def test_backward_is_done_once_an_iteration_from_the_finalize_function_or_else_the_step(
    monkeypatch: pytest.MonkeyPatch, offloaders: list
) -> None:
    """Megatron-LM's loop calls the finalize function, then the step: the state starts back once, from the first;
    a loop without a finalize function starts it from the step; every iteration anew."""
    brought: list[OffloadHandle] = []
    monkeypatch.setattr(finalize_prefetch, "bring_back_for_step", lambda handle: brought.append(handle) or 0)
    handle = handle_with_room(monkeypatch, offloaders, 0)
    finalize = finalize_prefetch.PrefetchOnFinalize(lambda: None, handle)
    for _ in range(3):  # Megatron-LM's loop
        finalize()
        handle.backward_done()  # the step wrapper's call: done already
        handle._after_step(stepped=True)
    assert brought == [handle] * 3
    handle.backward_done()  # a loop without a finalize function
    handle._after_step(stepped=True)
    assert len(brought) == 4
