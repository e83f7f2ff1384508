"""The streams and events copies run on: a side stream per direction beside the compute stream on
CUDA; immediate copies on the CPU. Everything the copy core and its users know of the device goes
through ``Streams``, so CPU tests can hand them events that complete only when a test says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

__all__ = ["CudaStreams", "Event", "HostStreams", "OFFLOAD", "PREFETCH", "StreamSwitch", "Streams"]

OFFLOAD = "offload"  # GPU to host
PREFETCH = "prefetch"  # host to GPU

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (destination, source)


class Event(Protocol):
    """What the engine needs of a ``torch.cuda.Event``."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Streams(Protocol):
    """The device as the engine sees it."""

    timed: bool

    def mark(self, timed: bool = False) -> Event | None: ...

    def copy(self, direction: str, pairs: Pairs, after: Event | None) -> tuple[Event | None, Event | None]: ...

    def compute_waits(self, event: Event) -> tuple[Event | None, Event | None]: ...

    def wait(self, event: Event) -> None: ...

    def block(self, nbytes: int) -> torch.Tensor: ...

    def keep_until_copied(self, tensor: torch.Tensor, direction: str) -> None: ...


class CudaStreams:
    """A side stream per direction: copies out and back use both copy engines, never behind training's
    kernels. Blocks come from the compute stream's pool, the one activations use."""

    timed = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.current_stream(device)  # fixed at attach: training's stream
        self.side = {OFFLOAD: torch.cuda.Stream(device), PREFETCH: torch.cuda.Stream(device)}
        self.on = StreamSwitch(self.compute.device_index)

    def mark(self, timed: bool = False) -> torch.cuda.Event:
        """The compute stream's current end: once it has completed, every kernel queued so far is done.
        ``timed``: an event that records time (sleep's per-part figures); the copies' marks need none."""
        event = torch.cuda.Event(enable_timing=timed)
        event.record(self.compute)
        return event

    def copy(self, direction: str, pairs: Pairs, after: Event | None) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue the copies on the direction's stream; returns their (start, end) events. ``after``, waited
        for on the device, must already be queued (never work that could be held back behind this)."""
        stream = self.side[direction]
        if after is not None:
            stream.wait_event(after)  # on the device, behind work already queued: it always proceeds
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self.on(stream):
            start.record(stream)
            for destination, source in pairs:
                destination.copy_(source, non_blocking=True)
            end.record(stream)
        return start, end

    def compute_waits(self, event: Event) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Order the compute stream after ``event`` (a copy already queued), timing the wait."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.compute)
        self.wait(event)
        end.record(self.compute)
        return start, end

    def wait(self, event: Event) -> None:
        """Order the compute stream after ``event``, untimed: where nobody reads how long it stood."""
        self.compute.wait_event(event)  # on the device: the host goes on queueing the step

    def block(self, nbytes: int) -> torch.Tensor:
        with self.on(self.compute):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def keep_until_copied(self, tensor: torch.Tensor, direction: str) -> None:
        """``tensor`` (compute-stream memory) may be dropped now: the allocator hands its memory out again
        only once the copies queued so far on the direction's stream, which read it, are done."""
        tensor.record_stream(self.side[direction])  # the allocator checks this event itself: no host wait


class StreamSwitch:
    """``with switch(stream):`` makes ``stream`` (of the switch's device) current, and the one before it again
    after. The copies and blocks of a step's chunks pass here hundreds of times an iteration, often from hooks
    whose host time the GPU waits for: where the device is the current one this is a few calls into torch's C
    bindings (``torch.cuda.stream`` costs several times as much), and no switch where ``stream`` is current
    already. Elsewhere, or where those bindings are missing, it is ``torch.cuda.stream``."""

    def __init__(self, index: int) -> None:
        self.index = index
        bindings = [getattr(torch._C, name, None) for name in ("_cuda_getCurrentStream", "_cuda_setStream")]
        self.bindings = None if None in bindings else bindings
        self.current_device = getattr(torch._C, "_cuda_getDevice", None)

    def __call__(self, stream: torch.cuda.Stream) -> Switched | torch.cuda.StreamContext:
        if self.bindings is None or self.current_device is None or self.current_device() != self.index:
            return torch.cuda.stream(stream)
        return Switched(stream, self.index, *self.bindings)


class Switched:
    """One ``StreamSwitch`` use (an object each, as threads have current streams of their own)."""

    __slots__ = ("before", "get", "index", "put", "stream")

    def __init__(self, stream: torch.cuda.Stream, index: int, get: Callable, put: Callable) -> None:
        self.stream, self.index, self.get, self.put = stream, index, get, put
        self.before: tuple | None = None

    def __enter__(self) -> None:
        current = self.get(self.index)  # (stream id, device index, device type)
        stream = self.stream
        if current[0] != stream.stream_id:
            self.put(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)
            self.before = current

    def __exit__(self, *exc: object) -> None:
        if self.before is not None:
            stream_id, index, kind = self.before
            self.put(stream_id=stream_id, device_index=index, device_type=kind)


class Done:
    """An event that has completed, at a time on the host's clock (the CPU's copies are synchronous)."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: Done) -> float:
        """Milliseconds to ``end``, as ``torch.cuda.Event.elapsed_time`` gives them."""
        return (end.at - self.at) * 1e3

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostStreams:
    """Copies done at once on the host: the engine's bookkeeping without a GPU. Tests subclass it to
    hand out events that complete later, or copies that fail."""

    timed = False

    def mark(self, timed: bool = False) -> Event | None:
        return Done() if timed else None

    def copy(self, direction: str, pairs: Pairs, after: Event | None) -> tuple[Event | None, Event | None]:
        began = Done()
        for destination, source in pairs:
            destination.copy_(source)
        return began, Done()

    def compute_waits(self, event: Event) -> tuple[Event | None, Event | None]:
        event.synchronize()  # the CPU has no device-side order: the data must be there before it is used
        return None, None

    def wait(self, event: Event) -> None:
        self.compute_waits(event)  # one place for tests that watch the waits: a wait untimed is one too

    def block(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def keep_until_copied(self, tensor: torch.Tensor, direction: str) -> None:
        return None  # the CPU's copies are done when queued


def streams_for(device: torch.device | None) -> Streams:
    return CudaStreams(device) if device is not None and device.type == "cuda" else HostStreams()
