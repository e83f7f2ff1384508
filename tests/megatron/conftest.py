"""Fixtures of the training hooks' tests (test_training_hooks.py, test_host_sizing.py, test_training_run.py)."""

from __future__ import annotations

import sys
import types

import pytest

from megatron_offload.megatron import training_hooks as megatron_training
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
