"""``--config FILE.yaml`` for Megatron command lines: the file's keys become flags placed before the
command line's own, so precedence is Megatron's defaults < the YAML file < the command line.

Keys are Megatron flag names (``num_layers`` or ``num-layers``); ``true`` gives the bare flag, ``false``
gives ``--no-NAME`` (``add_switch_inverses`` gives every switch that form), lists give several values,
other values ``--NAME=VALUE``, so that a value given to a switch is refused naming the switch. Unknown
keys are not ignored: Megatron's parser rejects them as unrecognized arguments. A parse error about a
flag the file gave (``use-distributed-optimizer: 3``, ``offload-chunk-mb: big``) names the file and the
key and says what to give (``parse_error``).

``python -m megatron_offload.config.files ARGS...`` checks a training command line before torchrun
starts (``scripts/train.sh``): the config file, megatron.training, a CUDA GPU; one line and exit 2 if not.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import yaml

__all__ = [
    "NO_CUDA",
    "add_switch_inverses",
    "config_flags",
    "expand_config_argv",
    "missing_training_message",
    "needs_one_connection",
    "parse_error",
    "preflight",
]

NO_CUDA = (
    "megatron-offload: no CUDA GPU found: Megatron-LM's training loop needs one; "
    "the tests run without: bash scripts/test.sh"
)


def _load_yaml(path: str | Path) -> object:
    """The file's data; malformed YAML as one line naming the file, line and column."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"--config {path}: not valid YAML{where}: {error.problem or error.context}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path}: not valid YAML: {error}") from None


def _keys_and_flags(path: str | Path) -> list[tuple[str, list[str]]]:
    """Each key of the file with the command-line flags it stands for."""
    data = _load_yaml(path)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of Megatron flag names to values")
    found: list[tuple[str, list[str]]] = []
    for key, value in data.items():
        name = str(key).replace("_", "-")
        if value is True:
            found.append((str(key), [f"--{name}"]))
        elif value is False:  # the switch's opposite: no-NAME: false is --NAME
            found.append((str(key), [f"--{name[3:]}" if name.startswith("no-") else f"--no-{name}"]))
        elif value is None:
            raise ValueError(f"--config {path}: key {key!r} has no value; give one or remove the key")
        elif isinstance(value, list):
            found.append((str(key), [f"--{name}", *map(str, value)]))
        elif isinstance(value, dict):
            raise ValueError(f"--config {path}: key {key!r} holds a mapping; flags take scalars or lists")
        else:
            found.append((str(key), [f"--{name}={value}"]))  # one token: a switch given a value is refused by name
    return found


def config_flags(path: str | Path) -> list[str]:
    """The command-line flags a YAML config file stands for."""
    return [flag for _, flags in _keys_and_flags(path) for flag in flags]


class _FileFlag(str):
    """A flag token a ``--config`` file gave, knowing the file and the key (what ``parse_error`` names)."""

    origin: tuple[str, str]


def _file_flag(token: str, path: str, key: str) -> _FileFlag:
    flag = _FileFlag(token)
    flag.origin = (path, key)
    return flag


def expand_config_argv(argv: list[str]) -> list[str]:
    """Replace ``--config PATH`` (or ``--config=PATH``) in ``argv`` by the file's flags, put first. Each
    flag token the file gave knows its file and key (for ``parse_error``), also once in ``sys.argv``."""
    for index, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if index + 1 >= len(argv):
                    raise ValueError("--config needs a path to a YAML file")
                path, rest = argv[index + 1], argv[:index] + argv[index + 2 :]
            else:
                path, rest = arg.split("=", 1)[1], argv[:index] + argv[index + 1 :]
            if not Path(path).is_file():
                raise FileNotFoundError(f"--config {path}: no such file (see configs/ for the shipped ones)")
            flags = []
            for key, (flag, *values) in _keys_and_flags(path):
                flags += [_file_flag(flag, path, key), *values]
            return flags + expand_config_argv(rest)
    return argv


def parse_error(message: str, argv: list[str] | None = None) -> str | None:
    """argparse's message about a flag that a ``--config`` file gave in ``argv`` (default ``sys.argv``),
    as one line naming the file and the key and saying what to give; None when the flag did not come
    from a file, or the command line gives it too."""
    match = re.match(r"argument (\S+?): (.*)", message, re.DOTALL)
    if not match:
        return None
    names = match[1].split("/")
    tokens = [token for token in (sys.argv if argv is None else argv) if token.split("=", 1)[0] in names]
    from_files = [token for token in tokens if isinstance(token, _FileFlag)]
    if not from_files or len(from_files) != len(tokens):
        return None
    path, key = from_files[-1].origin
    problem = match[2]
    value = re.search(r"'(.*)'", problem)
    if problem.startswith("ignored explicit argument") and value:
        problem = f"{match[1].split('/')[0]} is an on/off switch: give true or false, not {value[1]}"
    elif problem.startswith("expected one argument"):
        problem = "needs a value; true and false are for on/off switches"
    elif re.match(r"invalid (float|int) value", problem) and value:
        kind = "a whole number" if "int" in problem.split()[1] else "a number"
        problem = f"expected {kind}, got {value[1]!r}"
    return f"--config {path}, key {key}: {problem}"


def needs_one_connection(argv: list[str]) -> bool:
    """Whether a Megatron command line (``--config`` included) runs tensor or context parallelism, for
    which megatron-core requires ``CUDA_DEVICE_MAX_CONNECTIONS=1``. The last value of a flag wins."""
    sizes = {"--tensor-model-parallel-size": 1, "--context-parallel-size": 1}
    flags = expand_config_argv(argv)
    for index, flag in enumerate(flags):
        name, _, inline = flag.partition("=")
        if name in sizes:
            value = inline or (flags[index + 1] if index + 1 < len(flags) else "1")
            sizes[name] = int(value) if value.strip().isdigit() else 1  # Megatron's parser names a bad one
    return any(size > 1 for size in sizes.values())


def add_switch_inverses(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every on/off switch of ``parser`` its opposite, hidden from --help: ``--no-NAME`` for a
    ``--NAME`` switch and ``--NAME`` for a ``--no-NAME`` one, so that ``NAME: false`` in a config file
    (or ``no-NAME: false``) turns the switch off (on) instead of failing as an unrecognized argument."""
    known = set(parser._option_string_actions)
    for action in list(parser._actions):
        if not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            continue
        for option in action.option_strings:
            if not option.startswith("--"):
                continue
            name = option[2:]
            inverse = "--" + (name[3:] if name.startswith("no-") else "no-" + name)
            if inverse in known:
                continue
            store = "store_false" if isinstance(action, argparse._StoreTrueAction) else "store_true"
            parser.add_argument(inverse, dest=action.dest, action=store, default=action.default, help=argparse.SUPPRESS)
            known.add(inverse)
    return parser


def missing_training_message() -> str:
    """Why megatron.training is missing and what to do, in one line: megatron-core >= 0.17, the wheels
    that ship it, requires Python >= 3.12."""
    try:
        installed = f"megatron-core {importlib.metadata.version('megatron-core')}"
    except importlib.metadata.PackageNotFoundError:
        installed = "no megatron-core"
    python = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info < (3, 12):
        todo = (
            f"which requires Python >= 3.12; this is Python {python} with {installed}: make the environment "
            "with Python 3.12 (PYTHON=python3.12 bash scripts/train.sh)"
        )
    else:
        todo = f"this Python has {installed}: pip install 'megatron-core>=0.17,<0.20'"
    return (
        "Megatron-LM's training loop (megatron.training) is not installed: megatron-core wheels ship it from "
        f"0.17 on (checked: 0.19.2), {todo}; or use the library API megatron_offload.attach_offloader(optimizer) "
        "in your own loop, which works with megatron-core 0.14 on Python 3.10 and later."
    )


def preflight(argv: list[str]) -> str | None:
    """What stops a training command line before anything starts (a bad config file, no
    megatron.training, no CUDA GPU), as one line; None when nothing does."""
    try:
        expand_config_argv(argv)
    except (ValueError, OSError) as error:
        return f"megatron-offload: {error}"
    try:
        has_training = importlib.util.find_spec("megatron.training") is not None
    except ImportError:  # no megatron package at all
        has_training = False
    if not has_training:
        return f"megatron-offload: {missing_training_message()}"
    import torch

    if not torch.cuda.is_available():
        return NO_CUDA
    return None


if __name__ == "__main__":
    problem = preflight(sys.argv[1:])
    if problem:
        print(problem, file=sys.stderr)
    sys.exit(2 if problem else 0)
