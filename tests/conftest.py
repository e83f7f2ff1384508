"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def upstream(tmp_path: Path) -> Path:
    """A stand-in for the copy of Megatron-LM's dev branch: the script the harness looks for."""
    folder = tmp_path / "megatron-lm-dev"
    (folder / "megatron" / "core" / "datasets").mkdir(parents=True)
    (folder / "pretrain_gpt.py").write_text("")
    return folder
