"""The side-by-side benchmark's runs without a GPU: a row's reason from its log, a logged link speed, the early
stop when nothing can run, no benchmark importing the test package, and every benchmark starting from the
checkout."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import megatron_job as job
from benchmarks import megatron_side_by_side as side
from benchmarks import run_logs

ROOT = Path(__file__).resolve().parents[1]


TORCHRUN_TAIL = """E1125 05:37:02.394000 7127 /x/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
scripts/pretrain_gpt.py FAILED
------------------------------------------------------------
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


@pytest.mark.parametrize(
    ("own", "reason"),
    [
        ("megatron-offload: no CUDA GPU found: Megatron-LM's training loop needs one\n",
         "megatron-offload: no CUDA GPU found: Megatron-LM's training loop needs one"),
        ("building...\n[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 224.00 MiB.\n"
         "[rank0]:[W1125 process_group.cpp] destroy_process_group() was not called\n",
         "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 224.00 MiB."),
        ("megatron-offload: out of GPU memory under --offload-gpu-memory-cap-gib 17.1, in a backward of iteration 4: "
         "asked for 224.00 MiB with 17.03 GiB reserved at the peak\n"
         "[rank0]:[W1128 20:34:00.545485184 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was "
         "not called before program exit, which can leak resources.\n",
         "megatron-offload: out of GPU memory under --offload-gpu-memory-cap-gib 17.1, in a backward of iteration 4: "
         "asked for 224.00 MiB with 17.03 GiB reserved at the peak"),
        ("", "scripts/pretrain_gpt.py FAILED"),
    ],
)  # fmt: skip
def test_a_row_says_why_it_did_not_run(own: str, reason: str) -> None:
    text = "$ python -m torch.distributed.run ...\n" + own + TORCHRUN_TAIL
    assert run_logs.failure_reason(text) == reason
    assert run_logs.did_not_fit(reason) is ("memory" in reason)


def test_a_logged_link_speed_is_read() -> None:
    assert run_logs.logged_link_gbps("| offload link d2h (GB/s): 51.2 |") == 51.2
    assert run_logs.logged_link_gbps("| lm loss: 1.0 |") is None


def test_nothing_runs_when_nothing_can(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(job, "run", lambda *a, **k: pytest.fail("a job was started"))
    monkeypatch.setattr(side, "preflight", lambda argv: "megatron-offload: no CUDA GPU found")
    monkeypatch.setattr(sys, "argv", ["megatron_side_by_side.py", "--out", str(tmp_path)])
    assert side.main() == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        "megatron_side_by_side: nothing can run: megatron-offload: no CUDA GPU found"
    ]
    monkeypatch.setattr(side, "preflight", lambda argv: None)
    monkeypatch.setattr(sys, "argv", ["megatron_side_by_side.py", "--megatron-lm", str(tmp_path / "none")])
    assert side.main() == 2
    assert "no pretrain_gpt.py there" in capsys.readouterr().out


def test_no_benchmark_imports_the_test_package() -> None:
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path.name} imports {names}"


@pytest.mark.parametrize(
    "module", ["offload_bandwidth", "sleep_wake", "megatron_side_by_side", "compare_memory", "snapshot_layout"]
)
def test_benchmarks_start_from_the_checkout_without_pythonpath(module: str) -> None:
    # The checkout is not on the path; what else is (megatron-core installed apart, as on the GPU machine) stays.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout
