"""The host-memory checks of the training hooks, against a stand-in for ``megatron.training``: the
state on a rank counted from Megatron's own estimate, before the tokenizer is built; a node without room
for it refused in one line in validation, before the model is built; and a host that refuses the state
at attach, in the same one line."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
import torch

from megatron_offload.megatron import host_sizing
from megatron_offload.megatron import training_hooks as megatron_training
from tests.megatron.training_stand_in import parse_and_validate


def test_a_node_without_room_for_the_state_stops_in_one_line_before_the_model_is_built(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_offload.core import host_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_sizing, "state_bytes_per_rank", lambda args: 40 * 2**30)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 16 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, "--offload-optimizer-states", "--use-distributed-optimizer")
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert line.startswith("megatron-offload: --offload-optimizer-states needs 40.00 GiB of host memory per rank x 2")
    assert "--no-offload-host-memory-check" in line
    capsys.readouterr()
    parse_and_validate(  # the check turned off: no refusal
        megatron,
        monkeypatch,
        "--offload-optimizer-states",
        "--use-distributed-optimizer",
        "--no-offload-host-memory-check",
    )


def test_the_state_on_a_rank_is_counted_from_megatrons_own_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    estimate = types.ModuleType("megatron.training.theoretical_memory_usage")
    estimate.compute_weight_and_optimizer_memory = lambda args: 1e9 * (6 + 12 / args.data_parallel_size)
    monkeypatch.setitem(sys.modules, "megatron.training.theoretical_memory_usage", estimate)
    args = argparse.Namespace(data_parallel_size=2, offload_master_weights=True)
    assert host_sizing.state_bytes_per_rank(args) == 6 * 10**9  # 1e9 params x 12 bytes / 2 ranks
    args.offload_master_weights = False
    assert host_sizing.state_bytes_per_rank(args) == 4 * 10**9
    assert host_sizing.state_bytes_per_rank(argparse.Namespace()) is None  # cannot count: no check here


def megatrons_count(args: argparse.Namespace) -> float:
    """As megatron.training.theoretical_memory_usage counts (0.19.2): it reads ``padded_vocab_size``,
    which Megatron sets only when it builds the tokenizer, after argument validation."""
    embedding = args.hidden_size * args.padded_vocab_size
    return (12 * args.hidden_size**2 * args.num_layers + embedding) * (6 + 12 / args.data_parallel_size)


def test_the_state_is_counted_before_the_tokenizer_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    estimate = types.ModuleType("megatron.training.theoretical_memory_usage")
    estimate.compute_weight_and_optimizer_memory = megatrons_count
    monkeypatch.setitem(sys.modules, "megatron.training.theoretical_memory_usage", estimate)
    args = argparse.Namespace(  # configs/tiny.yaml as validation leaves it: no padded_vocab_size yet
        num_layers=4, hidden_size=512, data_parallel_size=1, vocab_size=32000, make_vocab_size_divisible_by=128
    )
    params = 12 * 512**2 * 4 + 512 * 32000  # 32000 is a multiple of 128 already
    assert host_sizing.state_bytes_per_rank(args) == 12 * params
    assert not hasattr(args, "padded_vocab_size")  # counted on a copy: Megatron still pads it itself
    args.vocab_size = 32001
    assert host_sizing.state_bytes_per_rank(args) == 12 * (params + 512 * 128)  # padded to 32128
    del args.vocab_size  # a tokenizer's files will tell: the transformer layers alone, a lower bound
    assert host_sizing.state_bytes_per_rank(args) == 12 * 12 * 512**2 * 4


def test_a_node_too_small_is_refused_in_validation_before_the_tokenizer_exists(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPU drill's node-too-small case on the CPU: Megatron's count as it reads the arguments (no
    padded vocabulary yet), the node's memory shared as if by 4096 ranks: one line, in validation."""
    from megatron_offload.core import host_memory

    estimate = types.ModuleType("megatron.training.theoretical_memory_usage")
    estimate.compute_weight_and_optimizer_memory = megatrons_count
    monkeypatch.setitem(sys.modules, "megatron.training.theoretical_memory_usage", estimate)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory, "ranks_on_this_node", lambda: 4096)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 100 * 2**30)
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, "--offload-optimizer-states", "--use-distributed-optimizer")
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert line.startswith("megatron-offload: --offload-optimizer-states needs 0.32 GiB of host memory per rank x 4096")


def test_a_host_that_refuses_the_state_at_attach_is_one_line(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the estimate in validation could not count the model, the engine's exact check at attach
    refuses: the same one line, not a traceback."""
    from megatron_offload import HostMemoryError

    def refuse(*args: object, **kwargs: object) -> None:
        raise HostMemoryError("--offload-optimizer-states needs 9.00 GiB of host memory per rank x 8 rank(s)")

    monkeypatch.setattr(megatron_training, "attach_offloader", refuse)
    monkeypatch.setattr(megatron_training, "fix_torch_adam_checkpoints", lambda optimizer: None)
    megatron.global_vars.get_args = lambda: argparse.Namespace(offload_optimizer_states=True)
    with pytest.raises(SystemExit) as exit_:
        megatron.training.get_megatron_optimizer(None, [])
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and line.startswith("megatron-offload: --offload-optimizer-states needs 9.00 GiB")
