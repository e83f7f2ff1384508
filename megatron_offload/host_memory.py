"""Host buffers for offloaded state: exact-size pinned slabs and a check that the host has room.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned caching allocator rounds each block
up to a power of two, so 12 GiB of state would pin 16 GiB. We allocate ordinary (pageable) memory of
the exact size and pin it in place with ``cudaHostRegister``; pinning is slow (about 0.5 s per GiB),
so slabs are made once and reused for every step.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GIB = 1024**3

# Keep this much of the available host memory free for everything else the job needs.
HOST_MEMORY_HEADROOM = 0.9


class HostMemoryError(RuntimeError):
    """The host does not have room for the offloaded optimizer state."""


class HostSlab:
    """One flat CPU buffer of a single dtype, pinned in place when CUDA allows it."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.tensor = torch.empty(numel, dtype=dtype)
        self.pinned = False
        nbytes = self.nbytes
        if pin and nbytes > 0 and torch.cuda.is_available():
            error = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if error == 0:
                self.pinned = True
                # Unregister before the memory goes back to the C allocator, however we are dropped.
                self._unpin = weakref.finalize(self, _unregister, self.tensor.data_ptr())
            else:
                warnings.warn(
                    f"megatron-offload: could not pin {nbytes / GIB:.2f} GiB of host memory "
                    f"(cudaHostRegister error {error}); using pageable memory instead. Copies to and "
                    "from pageable memory run at roughly a third of the pinned speed and are not "
                    "asynchronous, so offloading will add visible time to every step. Raise the "
                    "locked-memory limit (ulimit -l) or free host memory to get pinned copies.",
                    stacklevel=3,
                )

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def release(self) -> None:
        """Unpin now rather than at garbage collection (the caller has synchronized its copies)."""
        if self.pinned:
            self._unpin()
            self.pinned = False


def _unregister(data_ptr: int) -> None:
    error = int(torch.cuda.cudart().cudaHostUnregister(data_ptr))
    if error != 0:
        logger.warning("cudaHostUnregister failed with error %d", error)


def available_host_bytes() -> int:
    """Memory the OS says a new allocation can get: MemAvailable, capped by a cgroup v2 limit."""
    available = _meminfo_available()
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise HostMemoryError("cannot read MemAvailable from /proc/meminfo")


def ranks_on_this_node() -> int:
    """How many processes of this job share the host (torchrun sets LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_host_room(bytes_per_rank: int, ranks: int | None = None, available: int | None = None) -> None:
    """Fail before pinning anything if every rank on this node together would not fit in host memory."""
    ranks = ranks_on_this_node() if ranks is None else ranks
    available = available_host_bytes() if available is None else available
    needed = bytes_per_rank * ranks
    if needed > available * HOST_MEMORY_HEADROOM:
        raise HostMemoryError(
            f"--offload-optimizer-states needs {bytes_per_rank / GIB:.2f} GiB of host memory per rank "
            f"x {ranks} rank(s) on this node = {needed / GIB:.2f} GiB, but only "
            f"{available / GIB:.2f} GiB is available (and {1 - HOST_MEMORY_HEADROOM:.0%} of it is "
            "kept free). Run fewer ranks per node, add --no-offload-master-weights to keep the fp32 "
            "master weights on the GPU, or use a larger data-parallel size so each rank holds a smaller "
            "shard. If this host's memory grows on demand (some VMs report too little at start), pass "
            "--no-offload-host-memory-check."
        )
