"""The rows of megatron_side_by_side.py: the acceptance matrix (each row's offload flags and cap), upstream's
rows and their base, the rows a profiled run can be made of, a row's file name, and each row's ratio and loss
equality to its base."""

from __future__ import annotations

import re
from typing import Any

OFFLOAD = ["--offload-optimizer-states"]
# Upstream's offloader (Megatron-LM dev, ChunkedOptimizerStateOffloader), with 512 MiB chunks. Its
# --offload-optimizer-states is a deprecated spelling of the same switch with chunk size 0: never given.
UPSTREAM_OFFLOAD = ["--chunked-optimizer-state-offload", "--optimizer-state-offload-chunk-size-mb", "512"]

# The acceptance matrix, per log interval: (name, offload flags, cap as a share of the
# state taken off the no-offload peak; None: uncapped). The capped no-offload runs are meant to fail.
MATRIX = (
    ("no offload", None, None),
    ("full offload (auto)", [], None),
    ("prefetch step", ["--offload-prefetch", "step"], None),
    ("fraction auto", ["--offload-fraction", "auto"], None),
    ("cap 90%: no offload", None, 0.9),
    ("cap 90%: auto", ["--offload-prefetch", "auto"], 0.9),
    ("cap 90%: finalize", ["--offload-prefetch", "finalize"], 0.9),
    ("cap 90%: step", ["--offload-prefetch", "step"], 0.9),
    ("cap 50%: no offload", None, 0.5),
    ("cap 50%: fraction auto", ["--offload-fraction", "auto"], 0.5),
)
MEANT_TO_FAIL = ("cap 90%: no offload", "cap 50%: no offload")
# Upstream's rows (--upstream-megatron-lm): (name, flags); the first is their base.
UPSTREAM = (("upstream no offload", []), ("upstream chunked offload", UPSTREAM_OFFLOAD))
UPSTREAM_BASE = UPSTREAM[0][0]
# Rows a profiled run can be made of (uncapped: a cap needs the uncapped runs' figures), and the default.
PROFILABLE = tuple(name for name, _, cap in MATRIX if cap is None) + tuple(name for name, _ in UPSTREAM)
PROFILED = ("no offload", "full offload (auto)", "prefetch step")


def slug(name: str) -> str:
    """A row's name as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def selected_upstream_rows(only: set[str], upstream: bool) -> list[tuple[str, list[str]]]:
    """Upstream's rows to run: none without a copy of upstream; with ``--only``, those it names, their
    base always with them."""
    if not upstream or (only and not only & {name for name, _ in UPSTREAM}):
        return []
    return [(name, flags) for name, flags in UPSTREAM if not only or name in only or name == UPSTREAM_BASE]


def compare(runs: dict[str, Any], base: str, names: list[str] | None = None) -> None:
    """Ratios to ``base`` and bitwise loss equality, written into each run (of ``names``, else all)."""
    reference = runs[base]
    for name, figures in runs.items():
        if "error" in figures or "error" in reference or (names is not None and name not in names):
            continue
        figures["x_base"] = figures["step_ms"] / reference["step_ms"]
        figures["losses_equal"] = figures["losses"] == reference["losses"]
