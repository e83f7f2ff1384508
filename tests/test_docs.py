"""What the README, the docs and the docstrings tell a user, checked against the code: the calls they
name exist."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_offload import OffloadHandle, OptimizerStateOffloader

ROOT = Path(__file__).resolve().parents[1]


def named_calls(text: str) -> set[str]:
    """``name(`` and ``a.b(`` written in double or single backquotes."""
    return set(re.findall(r"`+([A-Za-z_][\w.]*)\(", text))


def test_the_calls_the_offloader_docstring_names_exist() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    offloader = OptimizerStateOffloader(torch.optim.Adam([param]), pin_memory=False, check_host_memory=False)
    for call in named_calls(OptimizerStateOffloader.__doc__ or "") - {"streamed_step.run"}:
        owner = offloader
        for part in call.split("."):
            assert hasattr(owner, part), f"the docstring names {call}(), which OptimizerStateOffloader lacks"
            owner = getattr(owner, part)


def test_pump_is_on_the_copies_and_the_handle_not_the_offloader() -> None:
    assert not hasattr(OptimizerStateOffloader, "pump")
    assert callable(OffloadHandle.pump)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for paragraph in path.read_text().split("\n\n"):
            wrong = "OptimizerStateOffloader" in paragraph and re.search(r"`pump\(\)`", paragraph)
            assert not wrong, f"{path.name} names pump() among OptimizerStateOffloader's calls: {paragraph}"
