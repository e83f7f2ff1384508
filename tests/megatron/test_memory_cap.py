"""The GPU memory cap as the Python API gives it (``OffloadConfig.gpu_memory_cap_gib``): the planner plans
against the config's cap, and ``attach_offloader`` applies it, on a CPU with CUDA's calls stood in for."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_offload.config.options import OffloadConfig
from megatron_offload.core import gpu_memory
from megatron_offload.core.units import GIB
from megatron_offload.megatron import optimizer_adapter
from megatron_offload.megatron.optimizer_adapter import OffloadHandle, attach_offloader

TOTAL = 80 * GIB


@pytest.fixture
def fractions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """An 80 GiB GPU stood in for: the fractions set on the process, in order."""
    set_: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=TOTAL))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: set_.append((f, device)))
    monkeypatch.setattr(gpu_memory, "mapped_bytes", lambda: 0)
    for name in gpu_memory.ALLOCATOR_VARIABLES:  # fixed-size segments unless a test says otherwise
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gpu_memory, "_expandable_from_now", False)
    return set_


def test_the_planner_plans_against_the_configs_cap(fractions: list) -> None:
    handle = OffloadHandle(object(), OffloadConfig(gpu_memory_cap_gib=2.5))
    assert handle.scheduler.limit() == int(2.5 * GIB)
    assert gpu_memory.memory_limit_bytes(None, cap_bytes=3 * GIB) == 3 * GIB + gpu_memory.mapped_bytes()


def test_the_cap_sets_the_fraction_and_a_refusal_names_the_setting_given(fractions: list) -> None:
    assert gpu_memory.apply_memory_cap(20, 1) == 20 * GIB
    assert fractions == [(0.25, 1)]
    with pytest.raises(ValueError, match=r"^OffloadConfig.gpu_memory_cap_gib 100 must be above 0 and at most this GPU"):
        gpu_memory.apply_memory_cap(100, 0, "OffloadConfig.gpu_memory_cap_gib")
    with pytest.raises(ValueError, match=r"^--offload-gpu-memory-cap-gib 100 must be above 0"):
        gpu_memory.apply_memory_cap(100, 0)
    assert fractions == [(0.25, 1)]  # a refusal sets nothing


def test_uncapped_lifts_the_cap_it_is_given_and_sets_it_again(fractions: list) -> None:
    with gpu_memory.uncapped(20 * GIB, 0):
        assert fractions == [(1.0, 0)]
    assert fractions == [(1.0, 0), (0.25, 0)]
    with gpu_memory.uncapped(None, 0):
        pass
    assert len(fractions) == 2  # no cap: nothing to lift


@pytest.fixture
def attachable(monkeypatch: pytest.MonkeyPatch, fractions: list) -> types.SimpleNamespace:
    """An optimizer with no DistributedOptimizer in it, on a stand-in GPU: attach runs its wiring only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(optimizer_adapter, "_check_version", lambda: "stand-in")
    monkeypatch.setattr(optimizer_adapter, "distributed_optimizers", lambda optimizer: [])
    return types.SimpleNamespace(step=lambda: None)


def test_attach_applies_the_configs_cap(attachable: types.SimpleNamespace, fractions: list) -> None:
    handle = attach_offloader(attachable, gpu_memory_cap_gib=20)
    held = 20 * GIB - gpu_memory.EXPANDABLE_PAGE_BYTES  # expandable segments: one page under the cap
    assert fractions == [(held / TOTAL, 0)]
    assert handle.scheduler.limit() == held
    handle.detach()


@pytest.mark.parametrize(
    ("variable", "setting", "expandable"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", True),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True", True),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False", False),
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128", False),
    ],
)
def test_with_expandable_segments_the_allocator_is_held_one_page_under_the_cap(
    monkeypatch: pytest.MonkeyPatch, fractions: list, variable: str, setting: str, expandable: bool
) -> None:
    """Expandable segments map 20 MiB pages after checking a request against the fraction, so what the
    allocator reserves may pass the fraction by up to a page: the fraction is set a page under the cap, and
    the offloader decides against that same limit. With fixed-size segments the cap is the fraction."""
    monkeypatch.setenv(variable, setting)
    assert gpu_memory.expandable_segments_on() is expandable
    held = 20 * GIB - (gpu_memory.EXPANDABLE_PAGE_BYTES if expandable else 0)
    assert gpu_memory.apply_memory_cap(20, 0) == 20 * GIB  # the cap as given, for the messages that name it
    assert fractions == [(held / TOTAL, 0)]
    assert gpu_memory.memory_limit_bytes(0, cap_bytes=20 * GIB) == held


def test_attach_refusing_the_cap_undoes_itself(attachable: types.SimpleNamespace, fractions: list) -> None:
    step = attachable.step
    with pytest.raises(ValueError, match=r"^OffloadConfig.gpu_memory_cap_gib 100 must be above 0"):
        attach_offloader(attachable, OffloadConfig(gpu_memory_cap_gib=100))
    assert fractions == [] and attachable.step is step
    assert not hasattr(attachable, optimizer_adapter._HANDLE_ATTR)
