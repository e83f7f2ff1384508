"""Fixtures of the training hooks' tests (test_training_hooks.py, test_host_sizing.py, test_training_run.py) and of the
pacing hooks' (test_pacing.py, test_pacing_readings.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_offload.core.units import GIB
from megatron_offload.megatron import pacing
from megatron_offload.megatron import training_hooks as megatron_training
from tests.megatron.pacing_ledger import Ledger
from tests.megatron.training_stand_in import fake_megatron_training


@pytest.fixture
def megatron(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The stand-in installed and hooked; everything the hooks change is put back afterwards."""
    from megatron.core.datasets import utils as dataset_utils

    package = fake_megatron_training()
    for name in ("arguments", "training", "global_vars"):
        monkeypatch.setitem(sys.modules, f"megatron.training.{name}", getattr(package, name))
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setattr(dataset_utils, "compile_helpers", dataset_utils.compile_helpers)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("RANK", raising=False)
    megatron_training.install_training_hooks()
    return package


@pytest.fixture
def room(monkeypatch: pytest.MonkeyPatch):
    """A RoomForForward over a four-layer model on a GPU capped at 10 GiB; ``allocated`` is the reading."""
    allocated = {"bytes": 0, "peak": 0}

    def reading(peak: bool = False) -> int:
        allocated["peak"] = max(allocated["peak"], allocated["bytes"])
        return allocated["peak"] if peak else allocated["bytes"]

    monkeypatch.setattr(pacing, "allocated_bytes", reading)
    ledger = Ledger(10 * GIB)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    hooks = pacing.RoomForForward(ledger, [model])
    hooks.on_gpu = True  # the readings come from the test, not from CUDA
    return hooks, ledger, allocated, model
