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
from megatron_offload.host_memory import GIB, HOST_MEMORY_HEADROOM, available_host_bytes
from megatron_offload.parked_buffers import DEFAULT_CHUNK_BYTES, ParkedBuffers, Transfer

__all__ = ["DEFAULT_CHUNK_BYTES", "ParkedBuffers", "SleepError", "SleepReport", "Sleeper", "Transfer"]


class SleepError(RuntimeError):
    """A sleep or wake that cannot be done; nothing has moved."""


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


def _device_free() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


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
        for name in parts:
            part = self.buffers.get(name)
            if part is not None and [t.untyped_storage().nbytes() for t in part.tensors] != part.sizes:
                raise SleepError(
                    f"cannot sleep {name}: a buffer was freed or resized by someone else since (megatron-core's "
                    "offload_grad_buffers?): bring it back first"
                )
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
