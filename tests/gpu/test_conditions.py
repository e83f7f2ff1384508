"""Offloading under conditions users run with, each in a process of its own (tests/gpu/conditions.py):
a GPU memory cap below what training without offloading needs, and one hardware queue
(``CUDA_DEVICE_MAX_CONNECTIONS=1``, which Megatron requires for tensor parallelism on Hopper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests train a megatron-core GPT model", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core installed (scripts/device_check.sh does it)")

ROOT = Path(__file__).resolve().parents[2]
# A launcher's rendezvous (torchrun's, or exported by hand): the child would listen on MASTER_PORT where the test
# process's own group may listen already. Without them the child makes a world of one with no port.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_conditions(mode: str, **env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tests.gpu.conditions", mode],
        cwd=ROOT,
        # The allocator's defaults, as for a user of the library API (no launcher of ours set them).
        env={
            **{
                k: v
                for k, v in os.environ.items()
                if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", *LAUNCHER_VARIABLES)
            },
            **env,
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(figures))  # all of it in the log, whichever assertion fails first
    return figures


def assert_every_policy_matches(result: dict) -> None:
    for policy, run in result["runs"].items():
        assert "error" not in run, (policy, run)
        assert run["losses_equal"] and run["params_equal"], (policy, run)


def test_no_offload_fails_under_the_cap_and_every_policy_fits() -> None:
    result = run_conditions("cap")
    # The cap: the no-offload peak less 90% of the state, what offloading promises to save.
    assert result["no_offload_under_cap"].startswith("out of memory"), result
    assert_every_policy_matches(result)
    for policy, run in result["runs"].items():
        assert run["peak_reserved"] <= result["cap"], (policy, run, result["cap"])


def test_fraction_auto_keeps_what_fits_under_a_tighter_cap() -> None:
    result = run_conditions("fraction")
    # The cap takes half the state away from the no-offload peak: that run must fail, `auto` must keep
    # some of the state on the GPU (not all: it would not fit), fit, and match bit for bit.
    assert result["no_offload_under_cap"].startswith("out of memory"), result
    assert_every_policy_matches(result)
    run = result["runs"]["fraction auto"]
    assert 0 < run["kept_bytes"] < run["host_bytes"], run
    assert run["peak_reserved"] <= result["cap"], (run, result["cap"])


def test_one_hardware_queue_keeps_parity() -> None:
    result = run_conditions("parity", CUDA_DEVICE_MAX_CONNECTIONS="1")
    assert_every_policy_matches(result)
