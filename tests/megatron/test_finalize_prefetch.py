"""State starts back as gradients are finalized (all of it with ``--offload-prefetch finalize``, what the backward
did not bring with the default), but only once the default has decided what stays: until then (iterations 1 and 2)
the steps' peaks are read with all state in host memory, and state brought back early would be counted as what
training needs without it."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_offload.core.units import GIB
from megatron_offload.megatron.finalize_prefetch import PrefetchOnFinalize
from megatron_offload.optimizer_state.scheduler import Peaks, StateScheduler


class Handle:
    """``bring_back_for_step``'s view of an OffloadHandle, off the GPU: it records what was brought back."""

    def __init__(self) -> None:
        self.scheduler = StateScheduler(lambda: 10 * GIB)
        self.offloaders: list = []
        self.on_cuda = False
        self.prefetched: list[int | None] = []
        self.order: list[str] = []  # flushes and prefetches, in turn

    def step_footprint(self) -> int:
        return 0

    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False, now: bool = False) -> int:
        self.prefetched.append(max_bytes)
        self.order.append(f"prefetch now={now}")
        return 0


class Copies:
    """An offloader's copy queue, as the wrapper meets it: it records which directions were flushed."""

    def __init__(self, order: list[str] | None = None) -> None:
        self.flushed: list[str | None] = []
        self.order = [] if order is None else order

    def flush(self, direction: str | None = None) -> None:
        self.flushed.append(direction)
        self.order.append(f"flush {direction}")


class Offloader:
    """What the wrapper reads of an offloader: its copies, and the kept state not back yet."""

    def __init__(self, kept_to_come_back: int = 0) -> None:
        self.copies = Copies()
        self.kept_to_come_back = kept_to_come_back


def test_the_finalize_wrapper_tells_the_handle_backward_is_done_before_finalizing() -> None:
    """The copies back are issued before megatron-core's finalize function, whose gradient checks make the host
    wait for the GPU: issued after them, the host's time issuing them would hold back the gradient norm's kernels."""
    calls: list[str] = []
    handle = SimpleNamespace(backward_done=lambda: calls.append("backward done"))
    wrapper = PrefetchOnFinalize(lambda *args, **kwargs: calls.append(f"finalized {args} {kwargs}") or "out", handle)
    assert wrapper([1], num_tokens=7) == "out"
    assert calls == ["backward done", "finalized ([1],) {'num_tokens': 7}"]


def test_nothing_comes_back_early_until_what_stays_is_decided() -> None:
    """Iterations 1 and 2: the steps' peaks are read with all state in host memory."""
    from megatron_offload.megatron import finalize_prefetch

    handle = Handle()
    assert finalize_prefetch.bring_back_for_step(handle) == 0  # iteration 1
    handle.scheduler.start_step()
    handle.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)
    assert finalize_prefetch.bring_back_for_step(handle) == 0  # iteration 2: its peak is still being read
    assert handle.prefetched == []
    handle.scheduler.decide([[GIB, GIB]])  # after iteration 2's step
    finalize_prefetch.bring_back_for_step(handle)
    assert handle.prefetched == [None]  # off the GPU: all of it


def test_what_did_not_come_back_starts_back_as_the_step_begins_within_its_room(monkeypatch) -> None:
    """Backward done, the default starts back what the limit leaves beside what is allocated and the step's
    own buffers, copies in only and all at once (no point of ours runs until the step), each as it is queued;
    queued copies out stay queued, for the loop's next points."""
    from megatron_offload.core.streams import OFFLOAD, PREFETCH
    from megatron_offload.megatron import finalize_prefetch

    offloader = Offloader()
    handle = Handle()
    handle.on_cuda, handle.offloaders = True, [offloader]
    offloader.copies.order = handle.order
    handle.step_footprint = lambda: GIB
    monkeypatch.setattr(finalize_prefetch, "allocated_bytes", lambda: 3 * GIB)
    handle.scheduler.start_step()
    handle.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)
    assert finalize_prefetch.bring_back_for_step(handle) == 0 and handle.prefetched == []  # not decided yet
    handle.scheduler.decide([[GIB, GIB]])
    finalize_prefetch.bring_back_for_step(handle)
    assert handle.prefetched == [handle.scheduler.backward_room(4 * GIB)] and handle.prefetched[0] > 0
    assert offloader.copies.flushed == [PREFETCH] and OFFLOAD not in offloader.copies.flushed
    # What the backward's hooks queued starts first (earlier in the step's order), then each new chunk as queued.
    assert handle.order == [f"flush {PREFETCH}", "prefetch now=True"]


def test_the_step_after_the_decision_leaves_room_for_the_kept_state_it_brings_back(monkeypatch) -> None:
    """In the iteration after the decision the kept state is still in host memory: the step brings it back
    into blocks of its own, so what comes back early leaves room for it (a 4.27B GPT under 16 GiB ran out of
    memory where the early copies took that room)."""
    from megatron_offload.megatron import finalize_prefetch

    offloader = Offloader(kept_to_come_back=2 * GIB)
    handle = Handle()
    handle.on_cuda, handle.offloaders = True, [offloader]
    monkeypatch.setattr(finalize_prefetch, "allocated_bytes", lambda: 3 * GIB)
    handle.scheduler.start_step()
    handle.scheduler.observe_step_end(Peaks(4 * GIB, 4 * GIB), resident=0)
    handle.scheduler.decide([[GIB, GIB]])
    finalize_prefetch.bring_back_for_step(handle)
    assert handle.prefetched == [handle.scheduler.backward_room(5 * GIB)]
    offloader.kept_to_come_back = 8 * GIB  # more than the limit leaves: nothing comes back early
    finalize_prefetch.bring_back_for_step(handle)
    assert handle.prefetched[-1] == 0
