"""The cap on a GPU, with expandable segments (as our launcher and ``attach_offloader`` turn them on): requests
of a few MiB each, until memory runs out, in a process of its own (the allocator reads its settings once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
FILL = """
import json, torch
from megatron_offload.core import gpu_memory
cap = gpu_memory.apply_memory_cap(1.01, 0)
held = []
try:
    while True:
        held.append(torch.empty(3 * 2**20 + 4096, dtype=torch.uint8, device="cuda"))  # 4 MiB once rounded
except torch.OutOfMemoryError:
    pass
print(json.dumps({"cap": cap, "reserved": torch.cuda.max_memory_reserved(), "held": len(held)}))
"""


def test_what_the_allocator_reserves_never_passes_the_cap() -> None:
    """Expandable segments map 20 MiB pages after checking a request against the process's fraction; the
    cap holds the fraction a page under it, so the peak reserved stays under the cap, and within two pages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    done = subprocess.run([sys.executable, "-c", FILL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    page = 20 * 2**20
    assert figures["held"] > 0 and figures["cap"] - 2 * page <= figures["reserved"] <= figures["cap"], figures
