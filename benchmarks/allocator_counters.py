"""Run a Python script, then print the CUDA caching allocator's counters as one JSON line.

Under a GPU memory cap the allocator, when it finds no free block and may not grow, frees its cached
blocks and retries (``num_alloc_retries``), synchronizing every stream first (``num_sync_all_streams``),
which stalls the host behind every copy in flight; with expandable segments, each unmap and map shows as
``num_device_free`` and ``num_device_alloc``. A run that pays for these each iteration is not at its floor.

    torchrun --standalone --nproc-per-node 1 --no-python python3 -m benchmarks.allocator_counters \\
        scripts/pretrain_gpt.py --config configs/nightly_memory.yaml --offload-optimizer-states ...

Prints ``allocator counters: {...}`` last (on every rank), also when the script exits or fails.
"""

from __future__ import annotations

import json
import runpy
import sys

COUNTERS = (
    "num_alloc_retries",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "num_ooms",
    "reserved_bytes.all.peak",
    "allocated_bytes.all.peak",
)


def counters() -> dict[str, int] | None:
    """The counters of this process's current CUDA device (0 where the allocator never ran: it has no statistics
    until its first allocation); None without a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    return {name: stats.get(name, 0) for name in COUNTERS}


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m benchmarks.allocator_counters SCRIPT [ARGS...]")
    sys.argv = list(argv)  # the script sees its own arguments
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        found = counters()
        print(f"allocator counters: {json.dumps(found) if found is not None else 'no CUDA GPU'}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
