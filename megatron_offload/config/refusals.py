"""Refusals as tables: each row names a Megatron argument, a test of its value that says the combination
is not supported, and what to tell the user. ``refuse`` raises the first that applies, in one line naming
the flag, what it was given and what to do."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = [
    "CUDA_GRAPHS",
    "Check",
    "changed_flags",
    "flag",
    "is_not",
    "is_other_than",
    "on",
    "over_one",
    "refuse",
    "set_",
]

Test = Callable[[argparse.Namespace, str], bool]
Check = tuple[str, Test, str]  # (argument name, is it unsupported?, what to tell the user)


def is_other_than(value: object) -> Test:
    """Set, to anything but ``value``."""
    return lambda args, name: getattr(args, name, None) not in (None, value)


def is_not(value: object) -> Test:
    return lambda args, name: getattr(args, name, None) != value


def over_one(args: argparse.Namespace, name: str) -> bool:
    return (getattr(args, name, 1) or 1) > 1


def on(args: argparse.Namespace, name: str) -> bool:
    return bool(getattr(args, name, False))


def set_(args: argparse.Namespace, name: str) -> bool:
    return getattr(args, name, None) not in (None, False, "none")


# Every way Megatron runs layers under CUDA graphs, which replay kernels past the layers' Python hooks.
_GRAPHS = "cannot run under CUDA graphs (they bypass the layers' hooks)"
CUDA_GRAPHS: list[Check] = [
    ("enable_cuda_graph", on, f"{_GRAPHS}: drop it"),
    ("external_cuda_graph", on, f"{_GRAPHS}: drop it"),
    ("cuda_graph_impl", is_other_than("none"), f"{_GRAPHS}: use none"),
]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def refuse(args: argparse.Namespace, subject: str, checks: list[Check]) -> None:
    """Raise ValueError for the first row of ``checks`` whose argument ``args`` holds an unsupported value."""
    for name, unsupported, advice in checks:
        # A name missing from ``args`` is a parser without Megatron's flags (the launcher's early check of
        # ours): Megatron's own parse comes through here again with every name present.
        if hasattr(args, name) and unsupported(args, name):
            raise ValueError(f"{subject} {advice} (got {flag(name)} {getattr(args, name)})")


def changed_flags(args: argparse.Namespace, defaults: dict[str, object]) -> list[str]:
    """The flags among ``defaults`` (argument name: default) given another value, as the user wrote them
    (``--no-NAME`` for a switch that is on by default)."""
    flags = []
    for name, default in defaults.items():
        if getattr(args, name, default) != default:
            flag = name.replace("_", "-")
            flags.append(f"--no-{flag}" if default is True else f"--{flag}")
    return flags
