"""A stand-in for ``megatron.training`` (megatron-core wheels before 0.17 lack it, and it needs CUDA to
train), and its arguments parsed and validated as Megatron's scripts do: helpers of the training hooks'
tests (test_training_hooks.py, test_host_sizing.py, test_training_run.py); conftest.py installs it."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

MEGATRON_DUMP = "------------------------ arguments ------------------------"


def fake_megatron_training() -> types.ModuleType:
    """megatron.training's arguments, global_vars and training modules, reduced to what the hooks wrap;
    validate_args asserts and prints as Megatron's does."""
    arguments = types.ModuleType("megatron.training.arguments")

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
        for flag in ("--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--use-distributed-optimizer"):
            parser.add_argument(flag, action="store_true")
        parser.add_argument("--optimizer", default="adam")
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser.parse_args()

    def validate_args(args, defaults={}):  # noqa: B006 (Megatron's signature)
        if args.optimizer_cpu_offload:
            assert args.use_precision_aware_optimizer, "The optimizer cpu offload must be used in conjunction..."
        print(MEGATRON_DUMP)
        # configs/tiny.yaml's model as validation leaves it: no padded_vocab_size (the tokenizer sets it later)
        vars(args).update(num_layers=4, hidden_size=512, data_parallel_size=1, vocab_size=32000)
        args.make_vocab_size_divisible_by = 128
        return args

    arguments.parse_args, arguments.validate_args = parse_args, validate_args
    training = types.ModuleType("megatron.training.training")
    training.get_megatron_optimizer = lambda *a, **k: None
    training.print_rank_last = print
    package = types.ModuleType("megatron.training")
    package.arguments, package.training = arguments, training
    package.global_vars = types.ModuleType("megatron.training.global_vars")
    return package


def parse_and_validate(megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, *argv: str) -> object:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return megatron.arguments.validate_args(megatron.arguments.parse_args())
