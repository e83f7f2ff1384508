"""The launcher's answers in the order a newcomer needs them, with megatron.training absent (as in
megatron-core wheels before 0.17): our flags are checked first and ``SCRIPT --help`` lists them, then a
machine without a CUDA GPU is said so, and only then is Megatron-LM's training loop asked for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_offload import run
from megatron_offload.config.files import NO_CUDA

BASE = ["--use-distributed-optimizer"]


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A script that must never run, with megatron.training made unimportable."""
    monkeypatch.setitem(sys.modules, "megatron.training", None)  # `from megatron.training import` fails
    path = tmp_path / "pretrain_gpt.py"
    path.write_text("raise SystemExit('the script must not run')\n")
    return str(path)


@pytest.mark.parametrize("cuda", [False, True], ids=["no-gpu", "gpu"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--offload-fraction", "2"], "--offload-fraction must be 'auto' or a number from 0"),
        (["--offload-fraction", "most"], "argument --offload-fraction: expected 'auto' or a number from 0 to 1"),
        (["--offload-chunk-mb", "0"], "--offload-chunk-mb must be a positive number of MiB"),
        (["--offload-chunk-mb", "-1"], "--offload-chunk-mb must be a positive number of MiB"),
        (["--offload-chunk-mb", "nan"], "--offload-chunk-mb must be a positive number of MiB"),
        (["--offload-gpu-memory-cap-gib", "nan"], "--offload-gpu-memory-cap-gib must be a positive number of GiB"),
        (
            ["--offload-optimizer-states", "--optimizer-cpu-offload"],
            "--offload-optimizer-states cannot be combined with --optimizer-cpu-offload",
        ),
        (["--offload-optimizer-states", "--optimizer", "sgd"], "supports --optimizer adam only"),
        (["--offload-optimizer-states", "--async-save"], "cannot be combined with --async-save"),
        (["--offload-optimizer-states", "--use-torch-fsdp2"], "cannot be combined with --use-torch-fsdp2"),
        (
            ["--offload-optimizer-states", "--chunked-optimizer-state-offload"],
            "cannot be combined with --chunked-optimizer-state-offload",
        ),
    ],
)
def test_a_bad_offload_flag_is_named_before_the_machine_or_the_install(
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cuda: bool,
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert run.main([script, *BASE, "--lr", "1e-4", *argv]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.startswith("megatron-offload: ") and message in line and out == ""
    assert "megatron.training" not in line and NO_CUDA not in line


def test_offloading_without_the_distributed_optimizer_is_named_too(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run.main([script, "--offload-optimizer-states"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "needs --use-distributed-optimizer" in line and "Add --use-distributed-optimizer" in line


def test_a_config_file_value_is_checked_as_the_command_line_is(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("offload-chunk-mb: 0\nuse-distributed-optimizer: true\n")
    assert run.main([script, "--config", str(config)]) == 2
    assert "--offload-chunk-mb must be a positive number" in capsys.readouterr().err


def test_script_help_lists_our_flags_and_says_why_megatrons_are_missing(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --help needs no GPU
    assert run.main([script, "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--offload-optimizer-states", "--offload-chunk-mb MIB", "--offload-fraction {auto,F}"):
        assert flag in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("Megatron-LM's own flags are not listed here: Megatron-LM's training loop")
    assert "0.17" in last


def test_good_flags_without_a_gpu_hear_of_the_gpu_before_the_install(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main([script, *BASE, "--offload-optimizer-states"]) == 2
    assert capsys.readouterr().err == NO_CUDA + "\n"


def test_good_flags_on_a_gpu_hear_what_to_install(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run.main([script, *BASE, "--offload-optimizer-states", "--offload-fraction", "auto"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("megatron-offload: Megatron-LM's training loop (megatron.training) is not installed")


def test_megatron_flags_the_check_does_not_know_pass_through(script: str) -> None:
    run.check_offload_flags(["--num-layers", "4", "--lr", "-1e-4", "--data-path", "a", "b", "--bf16"])
    run.check_offload_flags(
        [*BASE, "--offload-optimizer-states", "--offload-chunk-mb", "32", "--no-offload-master-weights"]
    )


def test_the_layer_order_reads_megatrons_untie_switch_from_the_command_line() -> None:
    weights = [
        *BASE,
        "--offload-optimizer-states",
        "--offload-weights",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        "--offload-weights-order",
        "layer",
    ]
    run.check_offload_flags([*weights, "--untie-embeddings-and-output-weights"])
    with pytest.raises(ValueError, match="--offload-weights-order layer needs untied embeddings"):
        run.check_offload_flags(weights)
