"""What the README, the docs and the docstrings tell a user, checked against the code: the calls they
name exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
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


def test_every_shipped_config_is_in_the_config_table() -> None:
    table = (ROOT / "docs" / "running.md").read_text()
    missing = [p.name for p in sorted((ROOT / "configs").glob("*.yaml")) if f"`configs/{p.name}`" not in table]
    assert missing in ([], ["nightly_thresholds.yaml"]), f"docs/running.md's config table lacks {missing}"


def test_weight_streaming_precision_is_worded_as_the_code_refuses() -> None:
    from megatron_offload.config.weight_flags import check_weight_flags

    wording = "`--bf16` or fp32 (not `--fp16`)"
    for path in (ROOT / "README.md", ROOT / "docs" / "weight-streaming.md"):
        assert wording in " ".join(path.read_text().split()), path.name
    args = argparse.Namespace(offload_weights=True, fp16=True)
    with pytest.raises(ValueError, match=r"supports --bf16 \(or fp32\) training only"):
        check_weight_flags(args, state_offload=True)


def test_the_layout_rule_is_stated_once() -> None:
    texts = {p.name: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    stating = [name for name, text in texts.items() if re.search(r"imports? only from", text)]
    assert stating == ["design.md"]


def test_the_product_is_described_the_same_everywhere() -> None:
    import megatron_offload

    setup = (ROOT / "setup.py").read_text()
    for text in (megatron_offload.__doc__ or "", setup, (ROOT / "README.md").read_text()):
        assert "weight streaming" in text.lower() and "optimizer-state offloading" in text.lower()


# Words about how the project was made, not what it does (spelled in pieces, so that this file is not a
# hit of the same search run with git grep); the process-group word stays where it is Unix's.
WORD = "sess" + "ion"
HISTORY = re.compile("|".join([r"issue [0-9]+", WORD, "device" + " call", "device" + " time"]), re.IGNORECASE)
UNIX_USAGE = re.compile(rf"start_new_{WORD}|{WORD} (of|it moved to)\b|own_{WORD}|getsid|setsid|\"{WORD} ")


def user_facing_files() -> list[Path]:
    folders = ["docs", "configs", "examples", "scripts", "benchmarks", "tests"]
    found = [ROOT / "README.md", *sorted((ROOT / "results").glob("*/README.md"))]
    for folder in folders:
        found += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return [p for p in found if p.suffix in (".md", ".py", ".sh", ".yaml", ".txt") or p.name == "README.md"]


def test_user_facing_text_says_what_it_does_not_how_it_was_made() -> None:
    hits = []
    for path in user_facing_files():
        if path == Path(__file__).resolve() or "data" in path.relative_to(ROOT).parts:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line) and not UNIX_USAGE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)
