"""Host buffers for offloaded state: exact-size pinned slabs and a check that the host has room.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned caching allocator rounds each block
up to a power of two, so 12 GiB of state would pin 16 GiB. We map anonymous memory of the exact size
and pin it in place with ``cudaHostRegister``; pinning is slow (about 0.5 s per GiB), so slabs are made
once and reused for every step.

Why ``mmap`` with ``MADV_DONTFORK``: Linux copies pages pinned for DMA into a child process at fork
time instead of sharing them, and training forks (data-loader workers start after the state is pinned):
each worker would cost a full copy of the slab (measured: +33 GB of host memory for a 31 GiB slab and
the run killed for lack of it). Children never read the state, so they get none of it.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import warnings
import weakref
from pathlib import Path

import torch

from megatron_offload.core.progress import MIN_BYTES, pin_progress
from megatron_offload.core.units import GIB, MIB

logger = logging.getLogger(__name__)


# Keep this much of the available host memory free for everything else the job needs.
HOST_MEMORY_HEADROOM = 0.9


class HostMemoryError(RuntimeError):
    """The host does not have room for the offloaded optimizer state."""


class HostSlab:
    """One flat CPU buffer of a single dtype, pinned in place when CUDA allows it.

    ``on_pin_failure``: "warn" falls back to pageable memory with a warning that says what it costs
    (measured then); "raise" stops with a ``HostMemoryError`` instead, before training starts. ``label``
    names the memory in the pinning progress lines and errors (sleep pins slabs of its own); ``announce=False``
    pins without progress lines (a caller making many slabs says what they add up to once)."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        pin: bool,
        on_pin_failure: str = "warn",
        *,
        label: str = "optimizer state's host memory",
        announce: bool = True,
    ) -> None:
        if on_pin_failure not in ("warn", "raise"):
            raise ValueError(f"on_pin_failure must be 'warn' or 'raise', got {on_pin_failure!r}")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        try:
            self._mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_DONTFORK"):  # Linux: forked children get none of it (see the module docstring)
                self._mapping.madvise(mmap.MADV_DONTFORK)
            self.tensor = (
                torch.frombuffer(self._mapping, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)
            )
        except (OSError, OverflowError, RuntimeError) as error:  # the host refused: say how much and what to do
            raise HostMemoryError(
                f"megatron-offload: could not allocate {nbytes / GIB:.2f} GiB of {label} "
                f"({_one_line(error)}); the host ran short. Free host memory, run fewer ranks "
                "per node, or add --no-offload-master-weights."
            ) from error
        self.pinned = False
        if pin and nbytes > 0 and _cuda_available():
            # Seconds per 10 GiB: say so (unless the caller sums its slabs up in a line of its own).
            with pin_progress(nbytes, label, min_bytes=MIN_BYTES if announce else nbytes + 1):
                error = _pin(self.tensor.data_ptr(), nbytes)
            if error == 0:
                self.pinned = True
                # Unregister before the memory goes back to the C allocator, however we are dropped.
                self._unpin = weakref.finalize(self, _unregister, self.tensor.data_ptr())
            else:
                self._pin_refused(error, on_pin_failure)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def _pin_refused(self, error: int, on_pin_failure: str) -> None:
        what = f"could not pin {self.nbytes / GIB:.2f} GiB of host memory (cudaHostRegister error {error})"
        advice = "Raise the locked-memory limit (ulimit -l) or free host memory to get pinned copies."
        if on_pin_failure == "raise":
            raise HostMemoryError(f"megatron-offload: {what}. {advice}")
        warnings.warn(
            f"megatron-offload: {what}; using pageable memory instead. {_pageable_cost(self.tensor, self.nbytes)} "
            f"Pageable copies are staged by the driver and hold the copy thread, so they overlap compute less. "
            f"{advice}",
            stacklevel=3,
        )

    def release(self) -> None:
        """Unpin now rather than at garbage collection (the caller has synchronized its copies)."""
        if self.pinned:
            self._unpin()
            self.pinned = False


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _pin(data_ptr: int, nbytes: int) -> int:
    """cudaHostRegister's error code (0: pinned); the pin-refused drills replace this function."""
    return int(torch.cuda.cudart().cudaHostRegister(data_ptr, nbytes, 0))


def _unregister(data_ptr: int) -> None:
    error = int(torch.cuda.cudart().cudaHostUnregister(data_ptr))
    if error != 0:
        logger.warning("cudaHostUnregister failed with error %d", error)


def _pageable_cost(slab: torch.Tensor, nbytes: int) -> str:
    """What moving the slab out and back once per step costs, pageable against pinned, measured on a
    sample of up to 256 MiB (a fraction of a second, once, and only when pinning was refused)."""
    sample = min(nbytes, 256 * MIB)
    try:
        pageable = slab.view(-1).view(torch.uint8)[:sample]
        pinned = torch.empty(sample, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(sample, dtype=torch.uint8, device="cuda")
        pageable_rates, pinned_rates = (_copy_gbps(device, host) for host in (pageable, pinned))
    except RuntimeError as error:  # the estimate is a courtesy: the warning goes out without it
        return f"(The cost could not be measured: {_one_line(error)}.)"
    return describe_cost(nbytes, pageable_rates, pinned_rates)


def describe_cost(nbytes: int, pageable: tuple[float, float], pinned: tuple[float, float]) -> str:
    """One sentence: the measured rates (GB/s to host, back) and the copy time per step each gives."""

    def seconds(rates: tuple[float, float]) -> float:
        return nbytes / 1e9 / rates[0] + nbytes / 1e9 / rates[1]

    return (
        f"Measured here: {pageable[0]:.1f} GB/s to host and {pageable[1]:.1f} GB/s back (pinned: {pinned[0]:.1f} "
        f"and {pinned[1]:.1f}), so moving {nbytes / GIB:.2f} GiB out and back each step takes about "
        f"{seconds(pageable):.2f} s of copying instead of {seconds(pinned):.2f} s."
    )


def _copy_gbps(device: torch.Tensor, host: torch.Tensor) -> tuple[float, float]:
    """GB/s of one copy device-to-host and one host-to-device, each after a warm-up copy."""
    rates = []
    for destination, source in ((host, device), (device, host)):
        destination.copy_(source)
        torch.cuda.synchronize()  # a clean start: nothing queued before is timed
        start = time.perf_counter()
        destination.copy_(source, non_blocking=True)
        torch.cuda.synchronize()  # the copy has landed: the time is the transfer's
        rates.append(source.numel() / 1e9 / max(time.perf_counter() - start, 1e-9))
    return rates[0], rates[1]


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
