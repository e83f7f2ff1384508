"""Sleep and wake: hand the GPU memory of a training job to someone else between training phases.

RL post-training runs an inference engine on the trainer's GPUs between updates. ``Sleeper.sleep()``
moves what the caller names (optimizer state through the engine's copy lanes; flat device buffers,
such as gradient and parameter buffers, whole) into pinned host memory, frees the device storage and
returns it to the device (``torch.cuda.empty_cache()``), so ``torch.cuda.mem_get_info`` shows it free
to other processes. ``wake()`` brings it all back, bitwise, into the same tensor objects.

This module knows nothing of Megatron: parts are optimizer offloaders and lists of tensors whose whole
storage is parked. Host slabs are pinned once, at the first sleep of a part, and reused; the host
memory every new slab needs is checked before anything moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_offload.engine import OptimizerStateOffloader
from megatron_offload.host_memory import GIB, HOST_MEMORY_HEADROOM, HostSlab, available_host_bytes

__all__ = ["DEFAULT_CHUNK_BYTES", "ParkedBuffers", "SleepError", "SleepReport", "Sleeper", "Transfer"]

DEFAULT_CHUNK_BYTES = 256 * 1024**2  # large enough that per-copy overhead is lost in the link time
ALIGN = 256  # each storage starts on this boundary in the host slab


class SleepError(RuntimeError):
    """A sleep or wake that cannot be done; nothing has moved."""


@dataclass
class Transfer:
    """One part moved in one direction."""

    part: str
    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class SleepReport:
    """What a ``sleep()`` or ``wake()`` moved, how long it took, and the device's free memory around it."""

    direction: str  # "sleep" or "wake"
    transfers: list[Transfer] = field(default_factory=list)
    seconds: float = 0.0
    device_free_before: int = 0  # torch.cuda.mem_get_info()[0]; 0 without CUDA
    device_free_after: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (a fresh view: the storage's memory changes at each move)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def _device_free() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


class ParkedBuffers:
    """Flat device buffers parked whole in one pinned host slab, pinned at the first park and reused.

    Each tensor's whole storage moves: every view of it (``param.data``, ``param.main_grad``, bucket
    views) stays a valid tensor object and sees the same bytes again after ``unpark()``.
    """

    def __init__(self, name: str, tensors: Sequence[torch.Tensor], chunk_bytes: int, pin_memory: bool = True) -> None:
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.pin_memory = pin_memory
        storages: dict[int, torch.Tensor] = {}
        for tensor in tensors:  # one entry per storage, even when several views of it are given
            storages.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        self.tensors = list(storages.values())
        self.sizes = [t.untyped_storage().nbytes() for t in self.tensors]
        self.slab: HostSlab | None = None
        self.parked = False

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def host_bytes_needed(self) -> int:
        """Host bytes a park would pin now (0 once the slab exists)."""
        return 0 if self.slab is not None else sum(_aligned(size) for size in self.sizes)

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device bytes, host bytes) of each storage, cut into chunks of at most ``chunk_bytes``."""
        pairs, offset = [], 0
        for tensor, size in zip(self.tensors, self.sizes, strict=True):
            device = _bytes_of(tensor.untyped_storage())
            for start in range(0, size, self.chunk_bytes):
                end = min(start + self.chunk_bytes, size)
                pairs.append((device[start:end], self.slab.tensor[offset + start : offset + end]))
            offset += _aligned(size)
        return pairs

    def park(self, side: torch.cuda.Stream | None) -> Transfer:
        """Copy every storage to the host slab, then free it on the device."""
        if self.slab is None:
            self.slab = HostSlab(self.host_bytes_needed(), torch.uint8, self.pin_memory)
        start = time.perf_counter()
        _copy([(host, device) for device, host in self._pairs()], side)
        for tensor in self.tensors:
            # Safe: _copy returned after the copies completed, and nothing else reads the buffer now.
            tensor.untyped_storage().resize_(0)
        self.parked = True
        return Transfer(self.name, self.nbytes, time.perf_counter() - start)

    def unpark(self, side: torch.cuda.Stream | None) -> Transfer:
        """Allocate every storage again (same size, new memory) and copy its bytes back."""
        start = time.perf_counter()
        for tensor, size in zip(self.tensors, self.sizes, strict=True):
            tensor.untyped_storage().resize_(size)  # on the compute stream, as the buffer was first made
        _copy(self._pairs(), side)
        self.parked = False
        return Transfer(self.name, self.nbytes, time.perf_counter() - start)


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], side: torch.cuda.Stream | None) -> None:
    """(destination, source) copies on the side stream, ordered after the compute stream's queued work
    and before its next work; returns once they have completed."""
    if side is None:  # no CUDA: plain copies, done when they return
        for destination, source in pairs:
            destination.copy_(source)
        return
    compute = torch.cuda.current_stream(side.device)
    # The copies read what queued kernels write (a sleep right after a step) or overwrite memory the
    # allocator may just have taken back from queued kernels (a wake): they start after that work.
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for destination, source in pairs:
            destination.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    # The compute stream must not touch the buffers before the copies have landed.
    compute.wait_event(done)
    # On the host: a sleep frees the device memory next and a caller's wake may step at once, so the
    # copies must be complete when we return (this is also what makes the timing exact).
    done.synchronize()


class Sleeper:
    """Sleep and wake for a set of named parts; one sleep at a time, each refused before anything moves.

    ``offloaders`` hold the optimizer state (and fp32 masters). With ``state_lives_on_host`` (the state
    is already offloaded between steps by an attached handle) a wake leaves it on the host, where the
    next step expects it; otherwise a wake brings it back to the device. ``buffers`` maps a part name
    to the tensors whose storages it parks. ``busy()`` returns why a sleep must wait (mid-step), or None.
    """

    OPTIMIZER = "optimizer"

    def __init__(
        self,
        offloaders: Sequence[OptimizerStateOffloader],
        buffers: dict[str, Sequence[torch.Tensor]],
        *,
        state_lives_on_host: bool = False,
        busy: Callable[[], str | None] = lambda: None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pin_memory: bool = True,
    ) -> None:
        self.offloaders = list(offloaders)
        self.buffers = {
            name: ParkedBuffers(name, tensors, chunk_bytes, pin_memory) for name, tensors in buffers.items()
        }
        self.state_lives_on_host = state_lives_on_host
        self.busy = busy
        self.asleep: tuple[str, ...] = ()  # the parts the current sleep moved; empty while awake
        self.last_report: SleepReport | None = None
        self._side: torch.cuda.Stream | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.OPTIMIZER, *self.buffers)

    @property
    def is_asleep(self) -> bool:
        return bool(self.asleep)

    def host_bytes_needed(self, parts: Sequence[str]) -> int:
        """Host memory a sleep of ``parts`` would newly pin (slabs that exist are reused)."""
        needed = sum(self.buffers[name].host_bytes_needed() for name in parts if name in self.buffers)
        if self.OPTIMIZER in parts:
            needed += sum(max(0, o.estimated_host_bytes() - o.stats.host_bytes) for o in self.offloaders)
        return needed

    def _check(self, parts: Sequence[str]) -> None:
        if self.asleep:
            raise SleepError(f"already asleep ({', '.join(self.asleep)}): call wake() before sleeping again")
        unknown = [name for name in parts if name not in self.parts]
        if unknown or not parts:
            raise SleepError(f"cannot sleep {unknown or 'nothing'}: choose among {', '.join(self.parts)}")
        reason = self.busy()
        if reason:
            raise SleepError(f"cannot sleep {reason}: call sleep() between training steps")
        needed = self.host_bytes_needed(parts)
        available = available_host_bytes()
        if needed > available * HOST_MEMORY_HEADROOM:
            raise SleepError(
                f"sleep needs {needed / GIB:.2f} GiB of new pinned host memory but {available / GIB:.2f} GiB is "
                f"available ({1 - HOST_MEMORY_HEADROOM:.0%} kept free): sleep fewer parts or free host memory"
            )

    def _stream(self) -> torch.cuda.Stream | None:
        tensors = [t for part in self.buffers.values() for t in part.tensors]
        if self._side is None and tensors and tensors[0].is_cuda:
            self._side = torch.cuda.Stream(tensors[0].device)
        return self._side

    def sleep(self, parts: Sequence[str] = (OPTIMIZER,)) -> SleepReport:
        """Move ``parts`` to pinned host memory and give their device memory back to the device."""
        parts = tuple(dict.fromkeys(parts))
        self._check(parts)
        if torch.cuda.is_available():
            # Cached blocks freed earlier (activations) would otherwise count as what this sleep gave back.
            torch.cuda.empty_cache()
        report = SleepReport("sleep", device_free_before=_device_free())
        start = time.perf_counter()
        if self.OPTIMIZER in parts:
            report.transfers.append(self._offload_state())
        for name in parts:
            if name in self.buffers:
                report.transfers.append(self.buffers[name].park(self._stream()))
        if torch.cuda.is_available():
            # What we freed sits in PyTorch's cache, still taken as far as the device is concerned.
            torch.cuda.empty_cache()
        report.seconds = time.perf_counter() - start
        report.device_free_after = _device_free()
        self.asleep, self.last_report = parts, report
        return report

    def _offload_state(self) -> Transfer:
        start = time.perf_counter()
        before = sum(o.offloaded_bytes for o in self.offloaders)
        for offloader in self.offloaders:
            offloader.offload()  # through the engine's lanes: never a chunk a lane is still copying
        for offloader in self.offloaders:
            # Blocks until the copies have landed and the lanes have dropped the device memory.
            offloader.host_copies_ready()
        moved = sum(o.offloaded_bytes for o in self.offloaders) - before
        return Transfer(self.OPTIMIZER, moved, time.perf_counter() - start)

    def wake(self) -> SleepReport:
        """Bring back everything the last sleep moved, bitwise, ready for the next training step."""
        if not self.asleep:
            raise SleepError("not asleep: wake() follows a sleep()")
        report = SleepReport("wake", device_free_before=_device_free())
        start = time.perf_counter()
        for name in self.asleep:  # the buffers (params first) before the state: the step reads it last
            if name in self.buffers:
                report.transfers.append(self.buffers[name].unpark(self._stream()))
        if self.OPTIMIZER in self.asleep:
            report.transfers.append(self._bring_state_back())
        report.seconds = time.perf_counter() - start
        report.device_free_after = _device_free()
        self.asleep, self.last_report = (), report
        return report

    def _bring_state_back(self) -> Transfer:
        if self.state_lives_on_host:  # the attached handle brings it back during the next step
            return Transfer(self.OPTIMIZER, 0, 0.0)
        start = time.perf_counter()
        moved = sum(o.offloaded_bytes for o in self.offloaders)
        for offloader in self.offloaders:
            offloader.wait()
        if torch.cuda.is_available():
            # The engine orders the compute stream after its copies; wait for them here so the time is
            # the transfer's and a caller's next kernels find the state in place.
            torch.cuda.current_stream().synchronize()
        return Transfer(self.OPTIMIZER, moved, time.perf_counter() - start)

    def close(self) -> None:
        """Wake if asleep, give every tensor its own device storage back and free every host slab."""
        if self.asleep:
            self.wake()
        if not self.state_lives_on_host:
            for offloader in self.offloaders:
                offloader.restore()
        for part in self.buffers.values():
            if part.slab is not None:
                part.slab.release()
                part.slab = None
