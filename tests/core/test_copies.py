"""The copy core on the CPU, with no optimizer: events that complete only when the test says so.

What it proves: a copy whose dependency has not completed is left for the next point; at most
``in_flight`` copies run per direction; the memory a copy holds is dropped only once it has landed;
a failed copy is raised at the next point, naming what it copied and which way; ``drain`` blocks
until copies have landed and counts what they free; ``release`` gives back what copies out read with
the compute stream waiting on the device, the host never, the copies in flight until they land.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from megatron_offload.core.copies import IN_FLIGHT, Copy, CopyError, CopyQueue
from megatron_offload.core.streams import OFFLOAD, PREFETCH, HostStreams
from tests.gates import Gate


class GatedStreams(HostStreams):
    """Copies happen at once (host memory); their end events complete by hand. The compute stream's
    waits are recorded, not made: a device wait leaves the host going on."""

    def __init__(self) -> None:
        self.started: list[tuple[str, Gate]] = []
        self.compute_waited: list[Gate] = []

    def compute_waits(self, event):
        self.compute_waited.append(event)
        return None, None

    def copy(self, direction, pairs, after):
        super().copy(direction, pairs, after)
        self.started.append((direction, Gate()))
        return None, self.started[-1][1]


def a_copy(direction: str = OFFLOAD, after: Gate | None = None, **fields: object) -> tuple[Copy, torch.Tensor]:
    source, destination = torch.arange(8.0), torch.zeros(8)
    return Copy(direction, [(destination, source)], after=after, **fields), destination


def test_a_copy_whose_dependency_is_running_waits_for_the_next_point() -> None:
    streams, dependency = GatedStreams(), Gate()
    queue = CopyQueue(streams)
    copy, destination = queue_and_keep(queue, after=dependency)
    queue.pump()
    assert streams.started == [] and copy.done is None and not destination.any()  # left queued, not waited for
    dependency.open = True
    queue.pump()
    assert copy.done is streams.started[0][1] and torch.equal(destination, torch.arange(8.0))


def queue_and_keep(queue: CopyQueue, **fields: object) -> tuple[Copy, torch.Tensor]:
    copy, destination = a_copy(**fields)
    return queue.put(copy), destination


def test_at_most_in_flight_copies_per_direction_and_the_next_start_once_one_landed() -> None:
    streams = GatedStreams()
    queue = CopyQueue(streams)
    for direction in (OFFLOAD, PREFETCH):
        for _ in range(IN_FLIGHT + 2):
            queue_and_keep(queue, direction=direction)
    queue.pump()
    assert [d for d, _ in streams.started] == [OFFLOAD] * IN_FLIGHT + [PREFETCH] * IN_FLIGHT
    queue.pump()
    assert len(streams.started) == 2 * IN_FLIGHT  # none landed: nothing more starts
    streams.started[0][1].open = True  # the first copy out lands
    queue.pump()
    assert [d for d, _ in streams.started[2 * IN_FLIGHT :]] == [OFFLOAD]
    assert len(queue.queued(OFFLOAD)) == 1 and len(queue.queued(PREFETCH)) == 2


def test_memory_a_copy_holds_is_dropped_only_once_it_landed_and_the_callbacks_run_in_order() -> None:
    streams, events = GatedStreams(), []
    queue = CopyQueue(streams)
    held = torch.ones(4)
    watch = weakref.ref(held)
    copy, _ = a_copy(
        held=[held], on_start=lambda c: events.append("started"), on_landed=lambda c: events.append("landed")
    )
    queue.put(copy, now=True)
    del held
    queue.pump()
    assert watch() is not None and events == ["started"]  # in flight: the copy still holds it
    streams.started[0][1].open = True
    queue.pump()
    assert watch() is None and events == ["started", "landed"] and queue.idle  # landed: given back


def test_a_failed_copy_is_named_at_the_next_point_with_its_way() -> None:
    streams, failed = GatedStreams(), []
    queue = CopyQueue(streams)
    copy, _ = a_copy(PREFETCH, label="sleep's grads buffers", on_failed=lambda c, e: failed.append(c))
    queue.put(copy, now=True)
    streams.started[0][1].error = "injected: copy failed"
    with pytest.raises(CopyError, match=r"sleep's grads buffers, host to GPU \(RuntimeError: injected: copy failed\)"):
        queue.pump()
    assert failed == [copy] and queue.idle  # taken off the queue, the caller's handler ran first


def test_drain_starts_what_is_queued_waits_for_it_and_counts_what_copies_out_free() -> None:
    streams = GatedStreams()
    queue = CopyQueue(streams)
    copies = [queue_and_keep(queue, after=Gate(), frees=100)[0] for _ in range(3)]
    assert queue.drain(150) == 200  # oldest first, until at least 150 bytes were freed
    assert copies[2].done is not None and not queue.idle  # started on the way, not waited for
    assert queue.drain() == 100 and queue.idle


def test_a_cancelled_copy_never_starts() -> None:
    streams = GatedStreams()
    queue = CopyQueue(streams)
    copy, destination = queue_and_keep(queue)
    queue.cancel(copy)
    queue.flush()
    assert streams.started == [] and queue.idle and not destination.any()


def test_release_orders_the_compute_stream_after_the_oldest_copies_out_and_drops_their_memory_at_once() -> None:
    streams, released = GatedStreams(), []
    queue = CopyQueue(streams)
    held = [torch.ones(4) for _ in range(3)]
    watches = [weakref.ref(tensor) for tensor in held]
    copies = [
        queue.put(a_copy(after=Gate(), held=[tensor], frees=100, on_released=released.append)[0]) for tensor in held
    ]
    del held
    assert queue.release(150) == 200  # oldest first, until at least 150 bytes: the third stays queued
    assert released == copies[:2] and streams.compute_waited == [c.done for c in copies[:2]]
    assert [w() is None for w in watches] == [True, True, False]  # given back now, behind the device wait
    assert not any(gate.open for _, gate in streams.started)  # the host waited for nothing
    assert queue.queued(OFFLOAD) == [copies[2]] and not queue.idle  # in flight until they land
    assert queue.release() == 100 and queue.release() == 0  # each copy is released once
    for _, gate in streams.started:
        gate.open = True
    queue.pump()
    assert queue.idle


def test_pending_bytes_count_what_is_queued_or_not_seen_landed_in_one_direction() -> None:
    streams = GatedStreams()
    queue = CopyQueue(streams)
    for _ in range(IN_FLIGHT + 1):
        queue_and_keep(queue, direction=PREFETCH)  # 8 float32s each
    queue_and_keep(queue, direction=OFFLOAD)
    queue.pump()
    assert queue.pending_bytes(PREFETCH) == (IN_FLIGHT + 1) * 32 and queue.pending_bytes(OFFLOAD) == 32
    streams.started[0][1].open = True  # the first copy out lands
    streams.started[1][1].open = True  # and the first copy in
    assert queue.pending_bytes(PREFETCH) == IN_FLIGHT * 32 and queue.pending_bytes(OFFLOAD) == 0
