"""Where Megatron-LM defines ``--offload-optimizer-states`` itself (its ``dev`` branch: a deprecated
``store_true`` alias, dest ``offload_optimizer_states``, of its ``--chunked-optimizer-state-offload``,
copied into ``OptimizerConfig`` by ``get_megatron_optimizer_config``, which then switches its own
offloader on): our flags parse without an argparse conflict, the flag attaches our offloader, Megatron's
stays off, the log says which runs, and Megatron's is still there by its own flag. Against a stand-in of
those parts of Megatron-LM, written after its dev tree."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types

import pytest
import torch

from megatron_offload.config.files import add_switch_inverses
from megatron_offload.config.flag_checks import check_offload_combinations
from megatron_offload.config.flags import add_offload_args, offload_requested
from megatron_offload.megatron import training_hooks

UPSTREAM_WARNING = "optimizer state offload is enabled with chunk size 0"


@dataclasses.dataclass
class UpstreamOptimizerConfig:
    """Megatron-LM dev's OptimizerConfig, its offload fields: the alias turns the replacement on."""

    use_distributed_optimizer: bool = False
    chunked_optimizer_state_offload: bool = False
    offload_optimizer_states: bool = False

    def __post_init__(self) -> None:
        if self.offload_optimizer_states:
            self.chunked_optimizer_state_offload, self.offload_optimizer_states = True, False


def upstream_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    group = parser.add_argument_group("training")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--optimizer", default="adam")
    group.add_argument("--chunked-optimizer-state-offload", action="store_true")
    group.add_argument("--optimizer-state-offload-fraction", type=float, default=1.0)
    group.add_argument("--offload-optimizer-states", action="store_true", dest="offload_optimizer_states")
    return parser


def upstream_config(args: argparse.Namespace) -> UpstreamOptimizerConfig:
    """get_megatron_optimizer_config: every field the namespace has."""
    fields = dataclasses.fields(UpstreamOptimizerConfig)
    return UpstreamOptimizerConfig(**{f.name: getattr(args, f.name) for f in fields if hasattr(args, f.name)})


def parse(*argv: str) -> argparse.Namespace:
    return add_switch_inverses(add_offload_args(upstream_parser())).parse_args(list(argv))


def test_our_flags_join_a_parser_that_defines_the_flag_without_a_conflict() -> None:
    parser = add_offload_args(upstream_parser())
    assert add_offload_args(parser) is parser  # a second call (a script's, then the hooks') adds nothing
    owners = [action for action in parser._actions if "--offload-optimizer-states" in action.option_strings]
    assert len(owners) == 1 and "megatron-offload" in owners[0].container.title
    lines = parser.format_help().splitlines()
    assert [line for line in lines if line.startswith("  --offload-optimizer-states")] == [
        "  --offload-optimizer-states"
    ]
    assert "--chunked-optimizer-state-offload" in owners[0].help


def test_the_flag_switches_ours_on_and_upstreams_config_sees_it_off() -> None:
    args = parse("--use-distributed-optimizer", "--offload-optimizer-states", "--offload-chunk-mb", "32")
    assert offload_requested(args) and args.offload_chunk_mb == 32
    assert args.offload_optimizer_states is False
    config = upstream_config(args)
    assert config.chunked_optimizer_state_offload is False and config.offload_optimizer_states is False
    check_offload_combinations(args)


def test_upstreams_own_flag_still_switches_upstreams_on_and_ours_off() -> None:
    args = parse("--use-distributed-optimizer", "--chunked-optimizer-state-offload")
    assert not offload_requested(args) and upstream_config(args).chunked_optimizer_state_offload is True
    args = parse("--use-distributed-optimizer", "--offload-optimizer-states", "--no-offload-optimizer-states")
    assert not offload_requested(args) and not upstream_config(args).chunked_optimizer_state_offload


def test_asking_for_both_offloaders_is_one_line_naming_both_flags() -> None:
    args = parse("--use-distributed-optimizer", "--offload-optimizer-states", "--chunked-optimizer-state-offload")
    with pytest.raises(ValueError, match="cannot be combined with --chunked-optimizer-state-offload") as error:
        check_offload_combinations(args)
    assert "Keep one" in str(error.value) and "\n" not in str(error.value)
    # upstream's own switch-off (a fraction of 0) leaves ours alone
    check_offload_combinations(
        parse(
            "--use-distributed-optimizer",
            "--offload-optimizer-states",
            "--chunked-optimizer-state-offload",
            "--optimizer-state-offload-fraction",
            "0",
        )  # fmt: skip
    )


def test_without_upstreams_flag_ours_keeps_its_dest() -> None:
    parser = argparse.ArgumentParser()
    args = add_offload_args(parser).parse_args(["--offload-optimizer-states"])
    assert args.offload_optimizer_states is True and offload_requested(args)


def stand_in_megatron_training(built: list[UpstreamOptimizerConfig]) -> types.ModuleType:
    """megatron.training's arguments, training and global_vars as the dev branch has them, reduced."""
    arguments = types.ModuleType("megatron.training.arguments")
    global_vars = types.ModuleType("megatron.training.global_vars")
    training = types.ModuleType("megatron.training.training")

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = upstream_parser()
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser.parse_args()

    def validate_args(args, defaults={}):  # noqa: B006 (Megatron's signature)
        if args.chunked_optimizer_state_offload or args.offload_optimizer_states:
            print(UPSTREAM_WARNING)
        global_vars.get_args = lambda: args
        return args

    def get_megatron_optimizer(config, model_chunks=None):
        built.append(config)
        return types.SimpleNamespace(config=config)

    arguments.parse_args, arguments.validate_args = parse_args, validate_args
    training.get_megatron_optimizer, training.print_rank_last = get_megatron_optimizer, print
    package = types.ModuleType("megatron.training")
    package.arguments, package.training, package.global_vars = arguments, training, global_vars
    return package


@pytest.fixture
def megatron(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, list, list]:
    from megatron.core.datasets import utils as dataset_utils

    built: list[UpstreamOptimizerConfig] = []
    attached: list[object] = []
    package = stand_in_megatron_training(built)
    for name in ("arguments", "training", "global_vars"):
        monkeypatch.setitem(sys.modules, f"megatron.training.{name}", getattr(package, name))
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setattr(dataset_utils, "compile_helpers", dataset_utils.compile_helpers)

    def attach(optimizer: object, config: object) -> types.SimpleNamespace:
        attached.append(optimizer)
        return types.SimpleNamespace(say=None)

    monkeypatch.setattr(training_hooks, "attach_offloader", attach)
    monkeypatch.setattr(training_hooks, "fix_torch_adam_checkpoints", lambda optimizer: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("RANK", raising=False)
    training_hooks.install_training_hooks()
    return package, built, attached


def train(megatron: tuple, monkeypatch: pytest.MonkeyPatch, *argv: str) -> argparse.Namespace:
    package = megatron[0]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--use-distributed-optimizer", *argv])
    args = package.arguments.validate_args(package.arguments.parse_args())
    package.training.get_megatron_optimizer(upstream_config(args), [])
    return args


def test_through_the_hooks_the_flag_attaches_ours_only_and_the_log_says_so(
    megatron: tuple, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, built, attached = megatron
    train(megatron, monkeypatch, "--offload-optimizer-states")
    (config,) = built
    assert config.chunked_optimizer_state_offload is False  # upstream's offloader is not switched on
    assert [optimizer.config for optimizer in attached] == [config]  # ours is attached
    out = capsys.readouterr().out
    assert UPSTREAM_WARNING not in out  # upstream's validation did not take the flag for its own
    assert "--offload-optimizer-states runs megatron-offload's offloader" in out
    assert "--chunked-optimizer-state-offload asks for it" in out


def test_through_the_hooks_upstreams_flag_runs_upstreams_only_and_the_log_says_so(
    megatron: tuple, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, built, attached = megatron
    train(megatron, monkeypatch, "--chunked-optimizer-state-offload")
    assert built[0].chunked_optimizer_state_offload is True and attached == []
    out = capsys.readouterr().out
    assert "--chunked-optimizer-state-offload runs Megatron-LM's own offloader; megatron-offload's is off" in out


def test_through_the_hooks_asking_for_both_is_one_line(
    megatron: tuple, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        train(megatron, monkeypatch, "--offload-optimizer-states", "--chunked-optimizer-state-offload")
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("megatron-offload: --offload-optimizer-states cannot be combined with --chunked-")
