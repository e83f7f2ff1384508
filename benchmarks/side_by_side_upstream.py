"""Upstream's rows of megatron_side_by_side.py (``--upstream-megatron-lm``): making a ``git archive`` copy
of Megatron-LM's dev branch start up, and the environment its runs get beside ours."""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
import sysconfig
from pathlib import Path


def prepare_upstream(path: Path) -> str:
    """Make upstream's start-up work from a ``git archive`` copy, and say how, for the results.

    Megatron's start-up runs ``make`` in megatron/core/datasets to build its C++ dataset helpers. An
    archive holds only the source, and the GPU machine may lack ``python3-config``, which the Makefile asks
    for the module's suffix. Where the installed megatron-core ships the module built from a byte-identical
    helpers.cpp, it is copied in (newer than the source, so make has nothing to do; ``upstream_env`` gives
    make the suffix); otherwise make builds it as upstream would."""
    if not (path / "pretrain_gpt.py").is_file():
        raise SystemExit(f"--upstream-megatron-lm {path}: no pretrain_gpt.py there (git archive dev megatron "
                         "pretrain_gpt.py gpt_builders.py model_provider.py)")  # fmt: skip
    datasets = path / "megatron" / "core" / "datasets"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if list(datasets.glob("helpers_cpp*")):
        return "upstream's dataset helpers: already built"
    for entry in sys.path:
        other = Path(entry or ".") / "megatron" / "core" / "datasets"
        built = other / f"helpers_cpp{suffix}"
        if other.resolve() == datasets.resolve() or not built.is_file() or not (datasets / "helpers.cpp").is_file():
            continue
        if (other / "helpers.cpp").is_file() and filecmp.cmp(other / "helpers.cpp", datasets / "helpers.cpp", False):
            shutil.copyfile(built, datasets / built.name)
            return f"upstream's dataset helpers: the installed megatron-core's module of the same helpers.cpp ({built})"
    return "upstream's dataset helpers: none prebuilt for the same source; upstream's start-up builds them (make)"


def upstream_env(path: Path, out: Path) -> dict[str, str]:
    """What upstream's runs get beside the environment: its folder first on PYTHONPATH (its megatron
    package shadows the installed one), make told the extension suffix (``prepare_upstream``), and the
    allocator setting our launcher gives our rows unless the caller chose one, so both sides run alike.
    Where there is no ``make`` but the helpers are built, a ``make`` that has nothing to do (written under
    ``out``) stands in, as the real one would have nothing to do."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(path.resolve()), os.environ.get("PYTHONPATH", "")) if p)}
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if suffix:
        env["MAKEFLAGS"] = " ".join(p for p in (os.environ.get("MAKEFLAGS", ""), f"LIBEXT={suffix}") if p)
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if shutil.which("make") is None and list((path / "megatron" / "core" / "datasets").glob("helpers_cpp*")):
        shim = out / "bin" / "make"
        shim.parent.mkdir(parents=True, exist_ok=True)
        shim.write_text("#!/bin/sh\necho 'make: no make here; the dataset helpers are built: nothing to be done'\n")
        shim.chmod(0o755)
        env["PATH"] = os.pathsep.join((str(shim.parent.resolve()), os.environ.get("PATH", "")))
    return env
