"""The run the training hooks keep (``TrainingRun``), against a stand-in for ``megatron.training``: one
run on the module they hook, installed once; the offloaders attached to it; the weights' log fields and
the iterations a log line covers; the GPU memory cap and the weight step mode read once in validation and
passed down."""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from megatron_offload.config.weight_flags import WeightConfig
from megatron_offload.core.units import GIB
from megatron_offload.megatron import training_hooks as megatron_training
from megatron_offload.megatron.training_run import RUN_ATTR, TrainingRun, current_run
from megatron_offload.megatron.weights_training import StreamedWeights
from megatron_offload.weights.stats import WeightStats
from tests.megatron.training_stand_in import parse_and_validate


def test_the_hooks_keep_one_run_on_the_module_they_hook_and_install_once(megatron: types.ModuleType) -> None:
    run = current_run()
    assert run is getattr(megatron.training, RUN_ATTR) and run == TrainingRun()
    wrapped = (megatron.arguments.parse_args, megatron.training.get_megatron_optimizer)
    megatron_training.install_training_hooks()  # a second call finds the run: nothing wrapped twice
    assert (megatron.arguments.parse_args, megatron.training.get_megatron_optimizer) == wrapped
    assert current_run() is run


def test_an_attached_offloader_is_the_runs(megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    handle = types.SimpleNamespace(say=None)
    monkeypatch.setattr(megatron_training, "attach_offloader", lambda optimizer, config: handle)
    monkeypatch.setattr(megatron_training, "fix_torch_adam_checkpoints", lambda optimizer: None)
    megatron.global_vars.get_args = lambda: argparse.Namespace(offload_optimizer_states=True)
    megatron.training.get_megatron_optimizer(None, [])
    assert current_run().offloads == [handle] and megatron_training.attached_handles() == [handle]


def test_streamed_weights_log_what_moved_since_the_last_line() -> None:
    stats = WeightStats(bytes_in=4 * GIB, bytes_out=2 * GIB, exposed_ms=10.0)
    weights = StreamedWeights(handles=[types.SimpleNamespace(read_stats=lambda: stats)])
    assert " weights in/out per iter (GiB): 2.00/1.00 | weights exposed (ms): 5.0 |" in weights.log_fields(2)
    stats = WeightStats(bytes_in=5 * GIB, bytes_out=3 * GIB, exposed_ms=11.0)
    assert " weights in/out per iter (GiB): 1.00/1.00 | weights exposed (ms): 1.0 |" in weights.log_fields(1)


def line(iteration: int) -> str:
    """Megatron-LM's iteration log line, as ``training_log`` writes it."""
    return f" [2026-11-25 15:40:08] iteration {iteration:>8}/      10 | consumed samples: {8 * iteration:>12} |"


def test_a_log_line_covers_the_iterations_since_the_line_before() -> None:
    run = TrainingRun()
    # --log-interval 5 from iteration 0: the weights' and layer inputs' figures are divided by 5, not summed.
    assert [run.iterations_since_last_line(line(i), start=0) for i in (5, 10)] == [5, 5]
    resumed = TrainingRun()  # resumed from a checkpoint at iteration 7: its first line covers 8, 9 and 10
    assert [resumed.iterations_since_last_line(line(i), start=7) for i in (10, 15)] == [3, 5]
    assert TrainingRun().iterations_since_last_line("no iteration named here", start=0) == 1


def test_the_cap_validation_applies_is_the_runs_for_the_weights_build(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    applied: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(megatron_training, "apply_memory_cap", lambda cap, device: applied.append((cap, device)) or 7)
    assert current_run().gpu_memory_cap_bytes is None
    parse_and_validate(megatron, monkeypatch, "--offload-gpu-memory-cap-gib", "20")
    assert applied == [(20.0, 0)] and current_run().gpu_memory_cap_bytes == 7
    assert "megatron-offload: GPU memory capped at 20 GiB per process" in capsys.readouterr().out


def test_the_weight_step_mode_is_read_once_in_validation_and_passed_down(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parse_and_validate(megatron, monkeypatch, "--offload-weights-step", "megatron")
    config = current_run().weights.config
    assert (config.enabled, config.step, config.order) == (False, "megatron", "micro-batch")
    assert "tied embeddings" in config.why  # Megatron-LM ties them unless told otherwise

    handle, streamed = types.SimpleNamespace(say=None), []
    monkeypatch.setattr(megatron_training, "attach_offloader", lambda optimizer, config: handle)
    monkeypatch.setattr(megatron_training, "fix_torch_adam_checkpoints", lambda optimizer: None)
    monkeypatch.setattr(current_run().weights, "stream_step", lambda *args: streamed.append(args))
    # Megatron's args after validation no longer decide: the config read there does.
    megatron.global_vars.get_args = lambda: argparse.Namespace(offload_optimizer_states=True, offload_weights=True)
    megatron.training.get_megatron_optimizer(None, ["model"])
    assert streamed == []  # the config says weights are not streamed
    current_run().weights.config = WeightConfig(enabled=True)
    megatron.training.get_megatron_optimizer(None, ["model"])
    assert streamed == [(None, ["model"], handle)]


def test_a_weight_config_refuses_an_unknown_step() -> None:
    assert WeightConfig(enabled=True).streamed_step and not WeightConfig(enabled=True, step="megatron").streamed_step
    with pytest.raises(ValueError, match="--offload-weights-step must be one of streamed, megatron"):
        WeightConfig(step="fast")
    assert WeightConfig(enabled=True, order="layer").layer_major and not WeightConfig(order="layer").layer_major
    with pytest.raises(ValueError, match="--offload-weights-order decides between layer, micro-batch"):
        WeightConfig(order="auto")  # decided when read from the flags, never left to later
