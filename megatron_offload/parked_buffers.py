"""Flat device buffers parked whole in pinned host memory: the gradient and parameter buffers of a sleep.

Knows nothing of Megatron: a buffer is a tensor whose whole storage moves. Copies run on a side
stream in chunks, and a buffer's device storage is freed only once its copy has landed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_offload.host_memory import HostSlab
from megatron_offload.units import MIB

__all__ = ["DEFAULT_CHUNK_BYTES", "ParkedBuffers", "Transfer"]

DEFAULT_CHUNK_BYTES = 256 * MIB  # large enough that per-copy overhead is lost in the link time
ALIGN = 256  # each storage starts on this boundary in the host slab


@dataclass
class Transfer:
    """One part moved in one direction."""

    part: str
    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (a fresh view: the storage's memory changes at each move)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


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
