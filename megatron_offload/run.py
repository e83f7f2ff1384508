"""Run an unmodified Megatron-LM training script with optimizer-state offloading available:

    torchrun --standalone --nproc-per-node 1 -m megatron_offload.run pretrain_gpt.py [--config FILE.yaml] ARGS...
    torchrun --standalone --nproc-per-node 2 -m megatron_offload.run pretrain_gpt.py ... --offload-optimizer-states

The offload flags join Megatron's parser, are validated with Megatron's other arguments, and the
offloader is attached to the optimizer Megatron builds. Without --offload-optimizer-states the script
runs exactly as before. SCRIPT --help lists Megatron's flags and ours (ours alone, with what to install,
where Megatron-LM's training loop is missing).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import NoReturn

import torch

from megatron_offload.config.files import NO_CUDA, add_switch_inverses, expand_config_argv, parse_error
from megatron_offload.config.flag_checks import check_offload_combinations
from megatron_offload.config.flags import UPSTREAM_FLAG, add_offload_args
from megatron_offload.megatron.optimizer_adapter import OffloadFitError
from megatron_offload.megatron.out_of_memory import line_for, quiet_megatron_out_of_memory_warning
from megatron_offload.megatron.training_hooks import (
    MissingMegatronTraining,
    install_training_hooks,
)

USAGE = "usage: python -m megatron_offload.run SCRIPT [--config FILE.yaml] [SCRIPT ARGS...]"
HELP = ("-h", "--help")

# Megatron-LM's switches that our combination checks read, as Megatron-LM defines them (store_true).
MEGATRON_SWITCHES = (
    "--optimizer-cpu-offload",
    "--use-distributed-optimizer",
    "--async-save",
    "--use-megatron-fsdp",
    "--use-custom-fsdp",
    "--use-torch-fsdp2",
    "--optimizer-cuda-graph",
    "--untie-embeddings-and-output-weights",
    UPSTREAM_FLAG,
)


class _RefusingParser(argparse.ArgumentParser):
    """A parse error raised as ValueError, for the launcher to print in one line."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def help_text() -> str:
    """The launcher's help: how to call it, then the flags it adds to the script's."""
    flags = add_offload_args(argparse.ArgumentParser(usage=argparse.SUPPRESS, add_help=False))
    return f"{__doc__.strip()}\n\n{flags.format_help().strip()}"


def check_offload_flags(argv: list[str]) -> None:
    """Raise ValueError, naming the flag and what to do, for a bad offload flag on a script's command
    line: the checks the hooks make inside Megatron's validation, made here before anything is imported,
    so that they answer first, also where Megatron-LM's training loop is missing."""
    parser = _RefusingParser(add_help=False, allow_abbrev=False)
    for switch in MEGATRON_SWITCHES:
        parser.add_argument(switch, action="store_true")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--optimizer-state-offload-fraction", type=float, default=1.0)
    args, _ = add_switch_inverses(add_offload_args(parser)).parse_known_args(argv)
    check_offload_combinations(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in HELP:
        print(help_text() if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    script, *script_args = argv
    if not Path(script).is_file():
        print(f"megatron-offload: no such script: {script}\n{USAGE}", file=sys.stderr)
        return 2
    # In the order of what the user can fix fastest: the command line, then the machine (no GPU cannot be
    # installed away, so it comes before the advice to install Megatron-LM's training loop).
    try:
        script_args = expand_config_argv(script_args)
        check_offload_flags(script_args)
    except (ValueError, OSError) as error:  # the input: one line
        print(f"megatron-offload: {parse_error(str(error), script_args) or error}", file=sys.stderr)
        return 2
    wants_help = bool(set(HELP) & set(script_args))
    if not wants_help and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    try:
        install_training_hooks()
    except MissingMegatronTraining as error:
        if wants_help:  # ours, then why Megatron's are not listed
            print(f"{help_text()}\n\nMegatron-LM's own flags are not listed here: {error}")
            return 0
        print(f"megatron-offload: {error}", file=sys.stderr)
        return 2
    quiet_megatron_out_of_memory_warning()  # the line below says it, without megatron-core's traceback
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except OffloadFitError as error:  # a setting that cannot fit: one line, the state is whole on the host
        print(error, file=sys.stderr, flush=True)
        return 2
    except torch.OutOfMemoryError as error:  # the numbers and what would move more off the GPU, in one line
        print(line_for(error), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
