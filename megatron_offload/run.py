"""Run an unmodified Megatron-LM training script with optimizer-state offloading available:

    python -m megatron_offload.run pretrain_gpt.py [--config configs/tiny.yaml] ARGS... --offload-optimizer-states
    torchrun --nproc-per-node 2 -m megatron_offload.run pretrain_gpt.py ...

The offload flags join Megatron's parser, are validated with Megatron's other arguments, and the
offloader is attached to the optimizer Megatron builds. Without --offload-optimizer-states the script
runs exactly as before. SCRIPT --help lists Megatron's flags and ours.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import torch

from megatron_offload.config.files import NO_CUDA, expand_config_argv
from megatron_offload.config.flags import add_offload_args
from megatron_offload.megatron.optimizer_adapter import OffloadFitError
from megatron_offload.megatron.training_hooks import MissingMegatronTraining, install_training_hooks

USAGE = "usage: python -m megatron_offload.run SCRIPT [--config FILE.yaml] [SCRIPT ARGS...]"


def help_text() -> str:
    """The launcher's help: how to call it, then the flags it adds to the script's."""
    flags = add_offload_args(argparse.ArgumentParser(usage=argparse.SUPPRESS, add_help=False))
    return f"{__doc__.strip()}\n\n{flags.format_help().strip()}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text() if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    script, *script_args = argv
    if not Path(script).is_file():
        print(f"megatron_offload.run: no such script: {script}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        script_args = expand_config_argv(script_args)
        install_training_hooks()
    except (ValueError, OSError, MissingMegatronTraining) as error:  # the input or the install: one line
        print(f"megatron_offload.run: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not {"-h", "--help"} & set(script_args):
        print(NO_CUDA, file=sys.stderr)
        return 2
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except OffloadFitError as error:  # a setting that cannot fit: one line, the state is whole on the host
        print(error, file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
