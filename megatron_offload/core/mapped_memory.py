"""Host memory that CUDA kernels can read and write: a ``torch.cuda.MemPool`` whose blocks are pinned,
device-mapped host memory (``cuMemHostAlloc`` with ``DEVICEMAP``; under unified addressing the host
pointer is the device pointer).

Why: tensors allocated inside ``allocating()`` are ordinary CUDA tensors to every piece of code that
touches them (type checks, kernels, NCCL, checkpointing), while their bytes live in host RAM. So a
model's full weight and gradient buffers can be built there, never taking GPU memory, and every
consumer stays correct; only what reads them often should read a GPU copy instead (kernels on mapped
memory run at link speed, about 50 GB/s).

NOTE: PyTorch counts the pool's bytes as allocated and reserved, and against
``set_per_process_memory_fraction``: ``mapped_bytes()`` says how many, so that ``gpu_memory`` can keep
the cap and the reported figures about GPU memory alone.
NOTE: the two C functions the pluggable allocator needs are compiled once with the system C compiler
into a per-user cache (no CUDA headers: libcuda is opened at run time).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["MappedMemoryError", "MappedPool", "mapped_allocated_bytes", "mapped_bytes"]

_SOURCE = r"""
#include <dlfcn.h>
#include <stddef.h>
#include <sys/types.h>
typedef int (*host_alloc_t)(void **, size_t, unsigned int);
typedef int (*host_free_t)(void *);
static host_alloc_t host_alloc;
static host_free_t host_free;
static size_t mapped;
static int load(void) {
  if (host_alloc && host_free) return 1;
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!cuda) return 0;
  host_alloc = (host_alloc_t)dlsym(cuda, "cuMemHostAlloc");
  host_free = (host_free_t)dlsym(cuda, "cuMemFreeHost");
  return host_alloc && host_free;
}
/* CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP */
void *mo_mapped_alloc(ssize_t size, int device, void *stream) {
  void *ptr = NULL;
  if (!load() || host_alloc(&ptr, (size_t)size, 0x01 | 0x02) != 0) return NULL;
  __atomic_add_fetch(&mapped, (size_t)size, __ATOMIC_RELAXED);
  return ptr;
}
void mo_mapped_free(void *ptr, ssize_t size, int device, void *stream) {
  if (ptr && host_free(ptr) == 0) __atomic_sub_fetch(&mapped, (size_t)size, __ATOMIC_RELAXED);
}
size_t mo_mapped_bytes(void) { return __atomic_load_n(&mapped, __ATOMIC_RELAXED); }
"""

# Module-level on purpose, unlike the rest of the package's state: the compiled allocator is the process's,
# not an object's. The library is loaded once and never unloaded (PyTorch's allocator calls into it for as
# long as any pool's memory lives, and its C counter ``mapped`` counts every pool), and ``_pools`` lists
# every pool in the process because the figures ``gpu_memory`` takes them out of (PyTorch's) are the process's.
_library: ctypes.CDLL | None = None
_library_path: Path | None = None
_pools: list[MappedPool] = []


class MappedMemoryError(RuntimeError):
    """Device-mapped host memory could not be set up here (no C compiler, no CUDA driver)."""


def _build() -> Path:
    """Compile the allocator once per source version into ``~/.cache/megatron_offload`` (or
    ``$MEGATRON_OFFLOAD_CACHE``); a second process finds it there."""
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MEGATRON_OFFLOAD_CACHE", Path.home() / ".cache" / "megatron_offload"))
    target = cache / f"mapped_alloc_{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise MappedMemoryError(
            "megatron-offload: --offload-weights needs a C compiler (cc or gcc) once, to build its 20-line "
            "host-memory allocator; install one (e.g. apt-get install gcc) or set CC"
        )
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as work:
        source = Path(work) / "mapped_alloc.c"
        source.write_text(_SOURCE)
        built = Path(work) / target.name
        result = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", str(source), "-o", str(built), "-ldl"],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise MappedMemoryError(
                f"megatron-offload: building the host-memory allocator with {compiler} failed: "
                f"{' '.join(result.stderr.split())[:300]}"
            )
        os.replace(built, target)  # atomic: a concurrent rank sees the whole file or none
    return target


def _load() -> Path:
    global _library, _library_path
    if _library is None:
        _library_path = _build()
        _library = ctypes.CDLL(str(_library_path))
        _library.mo_mapped_bytes.restype = ctypes.c_size_t
    return _library_path


def mapped_bytes() -> int:
    """Bytes of device-mapped host memory this process holds through ``MappedPool``s (0 if none): what
    PyTorch counts as reserved for them."""
    return int(_library.mo_mapped_bytes()) if _library is not None else 0


def mapped_allocated_bytes() -> int:
    """Bytes of that memory held by live tensors: what PyTorch counts as allocated for them (the rest is
    cached in the pools, freed by a tensor but kept for reuse)."""
    return sum(segment["allocated_size"] for pool in _pools for segment in pool.pool.snapshot(include_traces=False))


class MappedPool:
    """A memory pool of pinned, device-mapped host memory for the current CUDA device."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise MappedMemoryError("megatron-offload: device-mapped host memory needs a CUDA GPU")
        path = _load()
        allocator = torch.cuda.memory.CUDAPluggableAllocator(str(path), "mo_mapped_alloc", "mo_mapped_free")
        self.pool = torch.cuda.MemPool(allocator.allocator())
        self._allocator = allocator  # the pool refers to it: keep it alive as long as the pool
        _pools.append(self)

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """CUDA allocations of this thread inside go to host memory (their tensors stay CUDA tensors)."""
        with torch.cuda.use_mem_pool(self.pool):
            yield
