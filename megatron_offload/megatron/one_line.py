"""How the training hooks tell the user something: a note once, from the first rank; a refusal in one line
on stderr, after which every rank exits; a parse error as argparse's last line only.

Megatron-LM's own ways would bury the point: an assertion's traceback, a usage text of several hundred
lines, or the same note from every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from megatron_offload.config.files import parse_error

__all__ = ["one_line_errors", "print_once", "refuse_bad_flags", "stop"]


def print_once(message: str) -> None:
    """Print on the first rank only (before torch.distributed exists, torchrun's RANK tells)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def stop(message: str) -> NoReturn:
    """End the run with one line on stderr (from the first rank; every rank exits)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


def refuse_bad_flags(check: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """Run one of our checks; a refusal ends the run in one line, as the input was the problem."""
    try:
        check(args)
    except ValueError as error:
        stop(f"megatron-offload: {error}")


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """A parse error as argparse's last line only: Megatron's usage text runs to hundreds of lines."""

    def error(message: str) -> NoReturn:
        from_file = parse_error(message)  # a value a --config file gave: the file and key, what to give
        if from_file:
            stop(f"megatron-offload: {from_file}")
        stop(f"{parser.prog}: error: {message} (--help lists the flags)")

    parser.error = error  # type: ignore[method-assign]
