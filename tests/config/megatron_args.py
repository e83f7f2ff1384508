"""A Megatron-LM-like argument namespace for the CPU tests of the flags (test_args.py, test_values.py)."""

from __future__ import annotations

import argparse


def megatron_like_args(**overrides: object) -> argparse.Namespace:
    """A namespace with the Megatron-LM attributes validation reads, set to a combination that works."""
    values = {
        "offload_optimizer_states": True,
        "optimizer_cpu_offload": False,
        "use_distributed_optimizer": True,
        "optimizer": "adam",
        "use_megatron_fsdp": False,
        "use_torch_fsdp2": False,
        "optimizer_cuda_graph": False,
    }
    values.update(overrides)
    return argparse.Namespace(**values)
