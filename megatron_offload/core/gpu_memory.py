"""The process's GPU memory settings: a cap (as if the GPU were smaller), the limit the offloader must
stay under, and expandable segments for PyTorch's caching allocator unless the user configured it.

Why expandable segments: the state comes back into memory that backward freed and leaves again while
the next forward allocates, in 64 MiB pieces. With fixed-size segments, those pieces split the large
blocks activations were in, and a later large request finds no single free block although enough
memory is free in total (measured: "tried to allocate 512 MiB" with 8.9 GiB reserved but unallocated).
Expandable segments map and unmap pages of one growing segment instead, so free memory is usable.

Device-mapped host memory (``mapped_memory``, where streamed weights and gradients live) counts in
PyTorch's allocated and reserved bytes and against the per-process fraction: the cap set here is GPU
memory on top of it, the limit is in the allocator's own accounting (mapped bytes included, so that it
compares with ``torch.cuda.memory_reserved()``), and ``gpu_only`` takes them out of a reading.

The cap is not kept here: its owner (``OffloadConfig.gpu_memory_cap_gib``, read from the flag once) passes it
to each function that needs it, in bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch

from megatron_offload.core.mapped_memory import mapped_allocated_bytes, mapped_bytes
from megatron_offload.core.units import GIB, MIB

logger = logging.getLogger(__name__)

__all__ = [
    "EXPANDABLE_PAGE_BYTES",
    "Reading",
    "allocated_bytes",
    "allocation_counters",
    "allocator_limit",
    "allocator_retries",
    "apply_memory_cap",
    "expandable_segments_from_now",
    "every_segment_remappable",
    "expandable_segments_on",
    "gpu_only",
    "memory_limit_bytes",
    "read_memory",
    "refresh_memory_cap",
    "uncapped",
    "use_expandable_segments_by_default",
]

ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"
CAP_FLAG = "--offload-gpu-memory-cap-gib"
"""How the cap is named in a refusal unless the caller names it otherwise (the Python API's field)."""
# With expandable segments the allocator checks a request against the process's fraction, then maps pages of
# its large pool, 20 MiB each, to serve it: what it reserves may pass the fraction by up to one page (measured:
# 11 MiB over a cap). Held that much under the cap, it stays under it.
EXPANDABLE_PAGE_BYTES = 20 * MIB

# Module-level on purpose: like the allocator it records a setting of, it is the process's (turned on, and
# said in the log, once per process, however many offloaders are attached).
_expandable_from_now = False


def use_expandable_segments_by_default(environ: dict[str, str] | None = None) -> str | None:
    """Before CUDA starts: turn on expandable segments unless the allocator is configured already.
    Returns the line to log, or None when the user's setting stands."""
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in ALLOCATOR_VARIABLES):
        return None
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return (
        f"megatron-offload: PYTORCH_CUDA_ALLOC_CONF was not set; using {EXPANDABLE_SEGMENTS} so that state "
        "moving in and out does not fragment GPU memory. Set PYTORCH_CUDA_ALLOC_CONF yourself to choose otherwise."
    )


def expandable_segments_from_now(environ: dict[str, str] | None = None) -> str | None:
    """After CUDA started (the library API, where no launcher set the variable first): turn expandable
    segments on for every segment the allocator makes from now on, which is where activations and state
    come and go. Returns the line to log, or None when the user's setting stands."""
    global _expandable_from_now
    environ = os.environ if environ is None else environ
    if _expandable_from_now or any(environ.get(n) for n in ALLOCATOR_VARIABLES) or not torch.cuda.is_available():
        return None
    try:
        torch.cuda.memory._set_allocator_settings(EXPANDABLE_SEGMENTS)
    except (AttributeError, RuntimeError) as error:  # an older torch, or a build without them
        return (
            f"megatron-offload: could not turn on {EXPANDABLE_SEGMENTS} at run time ({error}); state moving in "
            f"and out may fragment GPU memory: set PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS} before CUDA starts"
        )
    _expandable_from_now = True  # said once; the environment is left alone (child processes choose their own)
    return (
        f"megatron-offload: PYTORCH_CUDA_ALLOC_CONF was not set; {EXPANDABLE_SEGMENTS} from now on, so that "
        "state moving in and out does not fragment GPU memory. Set PYTORCH_CUDA_ALLOC_CONF to choose otherwise."
    )


def every_segment_remappable() -> bool:
    """Whether all the memory the allocator's default pool holds is in expandable segments, whose free
    pages it can unmap and map again where any request needs them. Not so where the model was built
    before expandable segments were turned on (the library API without ``PYTORCH_CUDA_ALLOC_CONF``): a
    block freed in the middle of such a fixed-size segment serves only requests that fit in it. Private
    pools (the device-mapped host memory's, CUDA graphs') are left out: activations and state never go there."""
    if not torch.cuda.is_available():
        return False
    try:
        segments = torch.cuda.memory._snapshot()["segments"]
    except (AttributeError, RuntimeError):  # a torch without the snapshot: say no, the safe answer
        return False
    return all(s.get("is_expandable", False) for s in segments if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0))


def apply_memory_cap(cap_gib: float, device: int, name: str = CAP_FLAG) -> int:
    """Let PyTorch's allocator use at most ``cap_gib`` GiB on ``device`` (as on a GPU that small), on top
    of the device-mapped host memory held now; returns the cap in bytes. Before the model is built,
    everything counts against it. ``name``: the setting to name in a refusal."""
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(cap_gib * GIB)
    if not 0 < cap <= total:
        raise ValueError(
            f"{name} {cap_gib:g} must be above 0 and at most this GPU's "
            f"{total / GIB:.1f} GiB; give the memory of the GPU you want to imitate."
        )
    refresh_memory_cap(cap, device, name)
    return cap


def refresh_memory_cap(cap_bytes: int | None, device: int, name: str = CAP_FLAG) -> None:
    """Set the allocator's fraction to the cap plus the device-mapped host memory held now (PyTorch
    counts that against the fraction although it takes no GPU memory). No-op without a cap."""
    if cap_bytes is None:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    allowed = allocator_limit(cap_bytes)
    if allowed > total:
        raise ValueError(
            f"{name} {cap_bytes / GIB:g} plus the {mapped_bytes() / GIB:.1f} GiB of "
            f"host memory the streamed weights use (PyTorch counts it as GPU memory) pass this GPU's "
            f"{total / GIB:.1f} GiB, which PyTorch's cap cannot express; give a smaller cap."
        )
    torch.cuda.set_per_process_memory_fraction(allowed / total, device)


def allocator_limit(cap_bytes: int) -> int:
    """The allocator's own limit for a cap, in its accounting: the cap, plus the device-mapped host memory
    (PyTorch counts it), less one page where expandable segments map memory (``EXPANDABLE_PAGE_BYTES``)."""
    return cap_bytes + mapped_bytes() - (EXPANDABLE_PAGE_BYTES if expandable_segments_on() else 0)


def expandable_segments_on() -> bool:
    """Whether the allocator makes expandable segments: turned on here, or in its configuration variables."""
    settings = ",".join(os.environ.get(name, "") for name in ALLOCATOR_VARIABLES).replace(" ", "").lower()
    return _expandable_from_now or EXPANDABLE_SEGMENTS.lower() in settings


@contextlib.contextmanager
def uncapped(cap_bytes: int | None, device: int) -> Iterator[None]:
    """Lift the cap (``cap_bytes``, None: none was set) while building into device-mapped host memory
    (those bytes would count against it), then set it again on top of what was built. Only host-memory
    allocations may happen inside."""
    if cap_bytes is not None:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    try:
        yield
    finally:
        refresh_memory_cap(cap_bytes, device)


def gpu_only(nbytes: int, allocated: bool = False) -> int:
    """A reading of PyTorch's reserved (or, ``allocated``, allocated) bytes less the device-mapped host
    memory in it. Peaks too: the mapped memory is built before training and stays as it is."""
    return max(0, nbytes - (mapped_allocated_bytes() if allocated else mapped_bytes()))


def device_index(device: torch.device | int | None) -> int:
    """The CUDA device's index: the one given, else the current one."""
    index = device if isinstance(device, int) or device is None else device.index
    return torch.cuda.current_device() if index is None else index


def memory_limit_bytes(device: torch.device | int | None, cap_bytes: int | None = None) -> int:
    """What this process's caching allocator can hold on ``device``: the cap (``cap_bytes``) when there is
    one, else the fraction set on the process, else what it holds now plus what the GPU has free."""
    if cap_bytes is not None:
        return allocator_limit(cap_bytes)
    index = device_index(device)
    read_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer torch only
    fraction = read_fraction(index) if read_fraction is not None else 1.0
    if fraction < 1.0:
        return int(fraction * torch.cuda.get_device_properties(index).total_memory)
    free, _ = torch.cuda.mem_get_info(index)
    return torch._C._cuda_memoryStats(index)["reserved_bytes"]["all"]["current"] + free


class Reading(NamedTuple):
    """The allocator's bytes held by live tensors, its bytes mapped (what the limit counts) and its retries so far."""

    allocated: int
    reserved: int
    retries: int


def allocated_bytes(peak: bool = False) -> int:
    """``torch.cuda.memory_allocated()`` (``peak``: ``max_memory_allocated()``) on the current device without
    flattening every allocator statistic into a new dict on each call, which the hooks would pay many times per
    iteration."""
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is None:
        return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    return stats(device_index(None))["allocated_bytes"]["all"]["peak" if peak else "current"]


def allocation_counters() -> tuple[int, int]:
    """Bytes allocated now on the current device, and bytes ever allocated (the allocator's running count), from
    one reading of its counters."""
    counts = torch._C._cuda_memoryStats(device_index(None))["allocated_bytes"]["all"]
    return counts["current"], counts["allocated"]


def read_memory(device: torch.device | int | None = None) -> Reading:
    """``torch.cuda.memory_allocated()``, ``memory_reserved()`` and ``allocator_retries()`` from one reading of
    the allocator's counters, without flattening every statistic into a new dict (hooks read it per layer)."""
    stats = torch._C._cuda_memoryStats(device_index(device))
    return Reading(
        stats["allocated_bytes"]["all"]["current"],
        stats["reserved_bytes"]["all"]["current"],
        int(stats.get("num_alloc_retries", 0)),
    )


def allocator_retries(device: torch.device | int | None = None) -> int:
    """Times the caching allocator has run out of room under the limit and retried since the process began:
    each retry synchronizes every stream (the host waits for every copy in flight) and hands its cached
    memory back to the driver, which later requests map again."""
    return read_memory(device).retries
