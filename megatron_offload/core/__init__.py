"""The copy core (no optimizer, no Megatron): copies, streams, pinned and mapped host memory, GPU limits."""

__all__ = [
    "copies",
    "gpu_memory",
    "host_memory",
    "mapped_memory",
    "progress",
    "stats",
    "streams",
    "units",
]
