"""Shared by the CPU tests of the nightly memory comparison (benchmarks/compare_memory.py): recorded logs, a
--from-logs run of the tool and the checks its report names. No GPU, no Megatron run.

The logs under tests/data/memory_logs/ are small synthetic ones in Megatron-LM 0.19.2's formats (6
iterations of configs/nightly_memory.yaml on one GPU).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import compare_memory

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "memory_logs"


RUNS = ("baseline", "step", "capped-no-offload", "capped-default")


def logs_dir(tmp_path: Path, cpu_offload: bool = True, **replace: tuple[str, str]) -> Path:
    """A --from-logs folder holding the fixture logs; ``replace``: run name (``_`` for ``-``) -> (old, new)
    text to change in that run's log."""
    folder = tmp_path / "logs"
    folder.mkdir()
    for name in RUNS + (("cpu-offload",) if cpu_offload else ()):
        shutil.copy(DATA / f"{name}.log", folder / f"{name}.log")
    for key, (old, new) in replace.items():
        log = folder / f"{key.replace('_', '-')}.log"
        text = log.read_text()
        assert old in text, f"{old!r} not in {log.name}"
        log.write_text(text.replace(old, new))
    return folder


def verdict(folder: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, dict]:
    """Run the tool in --from-logs mode; its exit code, printed output and report.json."""
    code = compare_memory.main(["--from-logs", str(folder), *extra])
    return code, capsys.readouterr().out, json.loads((folder / "report.json").read_text())


def results(report: dict) -> dict[str, bool]:
    return {check["name"]: check["passed"] for check in report["checks"]}


def failing(report: dict) -> list[str]:
    return [name for name, passed in results(report).items() if not passed]
