"""Flat device buffers parked whole in pinned host memory: the gradient and parameter buffers of a sleep.

Knows nothing of Megatron: a buffer is a tensor whose whole storage moves. This module only makes a
part's copies (a ``Copy`` of the copy core) and frees or grows storages; when they start, what they
wait for and when freeing is safe are decided by the caller (sleeper.py), which sees every part of a
sleep at once and lines them up on the link back to back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_offload.core.copies import Copy
from megatron_offload.core.host_memory import HostSlab
from megatron_offload.core.streams import OFFLOAD, PREFETCH, Event
from megatron_offload.core.units import MIB

__all__ = ["DEFAULT_CHUNK_BYTES", "ParkedBuffers", "Transfer"]

# Large enough that per-copy cost is lost in the link time (a 512 MiB copy takes about 10 ms at
# 50 GB/s); the engine's chunks of sleep's own offloaders use it too, where fewer chunks also means
# fewer block edges that the allocator cannot give back.
DEFAULT_CHUNK_BYTES = 512 * MIB
ALIGN = 256  # each storage starts on this boundary in the host slab


@dataclass
class Transfer:
    """One part moved in one direction (or, in a prepare report, one part's host memory pinned).

    ``seconds`` is the part's time on the link: from the moment its copies could start (the previous
    part's copies landed) until its last copy landed, read from CUDA events; on the CPU, the host time
    of its copies. ``setup_seconds`` is host time spent before its copies could be queued that the
    link did not hide (a wake allocating device memory while nothing else was copying)."""

    part: str
    nbytes: int
    seconds: float
    setup_seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (a fresh view: the storage's memory changes at each move)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class ParkedBuffers:
    """Flat device buffers parked whole in one pinned host slab, pinned once (``prepare()`` or the first
    park) and reused.

    Each tensor's whole storage moves: every view of it (``param.data``, ``param.main_grad``, bucket
    views) stays a valid tensor object and sees the same bytes again after the copies back.
    """

    def __init__(
        self,
        name: str,
        tensors: Sequence[torch.Tensor],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pin_memory: bool = True,
    ) -> None:
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
        """Host bytes a prepare or park would pin now (0 once the slab exists)."""
        return 0 if self.slab is not None else sum(_aligned(size) for size in self.sizes)

    def prepare(self) -> int:
        """Pin the host slab now, if it is not pinned yet (about 0.5 s per GiB); returns the bytes pinned."""
        needed = self.host_bytes_needed()
        if needed:
            label = f"host memory for sleep's {self.name} buffers"
            self.slab = HostSlab(needed, torch.uint8, self.pin_memory, label=label)
        return needed

    def intact(self) -> bool:
        """Every storage has the size it had when we were made (nobody else freed or resized it)."""
        return [t.untyped_storage().nbytes() for t in self.tensors] == self.sizes

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device bytes, host bytes) of each storage, cut into pieces of at most ``chunk_bytes``."""
        assert self.slab is not None, "prepare() pins the slab before anything moves"
        pairs, offset = [], 0
        for tensor, size in zip(self.tensors, self.sizes, strict=True):
            device = _bytes_of(tensor.untyped_storage())
            for start in range(0, size, self.chunk_bytes):
                end = min(start + self.chunk_bytes, size)
                pairs.append((device[start:end], self.slab.tensor[offset + start : offset + end]))
            offset += _aligned(size)
        return pairs

    def copy_out(self, after: Event | None) -> Copy:
        """Every storage's copy to the host slab, as one copy (its pieces queued at once, no host round
        trip between them), after ``after``. The caller frees the storages only once it landed."""
        pairs = [(host, device) for device, host in self._pairs()]
        return Copy(OFFLOAD, pairs, after=after, label=f"sleep's {self.name} buffers", frees=self.nbytes)

    def free(self) -> None:
        """Give every storage's device memory back to the caching allocator; views stay valid objects."""
        for tensor in self.tensors:
            tensor.untyped_storage().resize_(0)
        self.parked = True

    def allocate(self) -> None:
        """Grow every storage back to its size (new memory, on the current stream, as the buffer was made)."""
        for tensor, size in zip(self.tensors, self.sizes, strict=True):
            tensor.untyped_storage().resize_(size)

    def copy_in(self, after: Event | None) -> Copy:
        """Every storage's copy back from the host slab, as one copy, after ``after`` (the allocation)."""
        self.parked = False
        return Copy(PREFETCH, self._pairs(), after=after, label=f"sleep's {self.name} buffers")

    def release(self) -> None:
        """Unpin and drop the host slab (the caller has made sure no copy uses it)."""
        if self.slab is not None:
            self.slab.release()
            self.slab = None
