"""``--config FILE.yaml`` for Megatron command lines: the file's keys become flags placed before the
command line's own, so precedence is Megatron's defaults < the YAML file < the command line.

Keys are Megatron flag names (``num_layers`` or ``num-layers``); ``true`` gives the bare flag, ``false``
gives ``--no-NAME`` (only for flags that have that form), lists give several values. Unknown keys
are not ignored: Megatron's parser rejects them as unrecognized arguments.
"""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["config_flags", "expand_config_argv", "needs_one_connection"]


def config_flags(path: str | Path) -> list[str]:
    """The command-line flags a YAML config file stands for."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of Megatron flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        name = str(key).replace("_", "-")
        if value is True:
            flags.append(f"--{name}")
        elif value is False:
            flags.append(f"--no-{name}")
        elif value is None:
            raise ValueError(f"--config {path}: key {key!r} has no value; give one or remove the key")
        elif isinstance(value, list):
            flags += [f"--{name}", *map(str, value)]
        elif isinstance(value, dict):
            raise ValueError(f"--config {path}: key {key!r} holds a mapping; flags take scalars or lists")
        else:
            flags += [f"--{name}", str(value)]
    return flags


def expand_config_argv(argv: list[str]) -> list[str]:
    """Replace ``--config PATH`` (or ``--config=PATH``) in ``argv`` by the file's flags, put first."""
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
            return config_flags(path) + expand_config_argv(rest)
    return argv


def needs_one_connection(argv: list[str]) -> bool:
    """Whether a Megatron command line (``--config`` included) runs tensor or context parallelism, for
    which megatron-core requires ``CUDA_DEVICE_MAX_CONNECTIONS=1``. The last value of a flag wins."""
    sizes = {"--tensor-model-parallel-size": 1, "--context-parallel-size": 1}
    flags = expand_config_argv(argv)
    for index, flag in enumerate(flags):
        name, _, inline = flag.partition("=")
        if name in sizes:
            value = inline or (flags[index + 1] if index + 1 < len(flags) else "1")
            sizes[name] = int(value)
    return any(size > 1 for size in sizes.values())
