"""The hooks on Megatron-LM's training loop, against a stand-in for ``megatron.training`` (megatron-core
wheels before 0.17 lack it, and it needs CUDA to train): the order of the checks and their messages,
one line each, before Megatron's own assertions and its argument dump; the launcher's, before it runs a
script. The host-memory checks are test_host_sizing.py's, the run the hooks keep test_training_run.py's."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from megatron_offload import run
from megatron_offload.config.files import NO_CUDA, expand_config_argv
from megatron_offload.megatron import training_hooks as megatron_training
from tests.megatron.training_stand_in import MEGATRON_DUMP, parse_and_validate


def test_our_refusal_comes_before_megatrons_assertion_and_dump(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ("--offload-optimizer-states", "--optimizer-cpu-offload", "--use-distributed-optimizer")
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, *argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and MEGATRON_DUMP not in out
    (line,) = err.splitlines()
    assert line.startswith(
        "megatron-offload: --offload-optimizer-states cannot be combined with --optimizer-cpu-offload."
    )


def test_no_cuda_is_one_line_before_megatrons_dump(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        parse_and_validate(megatron, monkeypatch, "--use-distributed-optimizer")
    out, err = capsys.readouterr()
    assert err == NO_CUDA + "\n" and MEGATRON_DUMP not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--offload-fraction", "most"],
            "pretrain_gpt.py: error: argument --offload-fraction: expected 'auto' or a number from 0 to 1, "
            "got 'most' (--help lists the flags)",
        ),
        (["--offload-fraction", "2"], "megatron-offload: --offload-fraction must be 'auto' or a number from 0"),
        (["--offload-chunk-mb", "0"], "megatron-offload: --offload-chunk-mb must be a positive number of MiB"),
        (["--no-such-flag"], "pretrain_gpt.py: error: unrecognized arguments: --no-such-flag (--help lists the flags)"),
    ],
)
def test_bad_values_are_one_line_even_with_offloading_off(
    megatron: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, *argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and MEGATRON_DUMP not in out
    (line,) = err.splitlines()
    assert line.startswith(message)


def test_a_config_file_turns_megatron_switches_off_and_ignored_flags_are_named(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = tmp_path / "run.yaml"
    config.write_text("use-distributed-optimizer: false\noffload-fraction: 0.5\n")
    args = parse_and_validate(megatron, monkeypatch, *expand_config_argv(["--config", str(config)]))
    assert args.use_distributed_optimizer is False and args.offload_fraction == 0.5
    out = capsys.readouterr().out
    assert "megatron-offload: --offload-fraction has no effect without --offload-optimizer-states\n" in out
    assert MEGATRON_DUMP in out  # a working combination: Megatron's validation ran


def test_weight_streaming_flags_without_it_are_named(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parse_and_validate(megatron, monkeypatch, "--offload-weights-order", "layer", "--offload-weights-slots", "8")
    out = capsys.readouterr().out
    assert (
        "megatron-offload: --offload-weights-order, --offload-weights-slots have no effect without --offload-weights\n"
        in out
    )


def test_the_launcher_stops_without_cuda_before_running_the_script(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    monkeypatch.setattr(run, "install_training_hooks", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main([str(script), "--lr", "1"]) == 2
    assert capsys.readouterr().err == NO_CUDA + "\n"


def test_the_launcher_names_a_bad_config_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    (tmp_path / "bad.yaml").write_text("lr: [1\n")
    assert run.main([str(script), "--config", str(tmp_path / "bad.yaml")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"megatron-offload: --config {tmp_path / 'bad.yaml'}: not valid YAML at line 2")


def test_the_launcher_help_lists_the_offload_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Run an unmodified Megatron-LM training script")
    for flag in ("--offload-prefetch {auto,finalize,step}", "--offload-chunk-mb MIB", "--offload-fraction {auto,F}"):
        assert flag in out
    assert "--offload-gpu-memory-cap-gib GIB" in out and "--no-offload-host-memory-check" in out


@pytest.mark.parametrize(
    ("yaml_line", "problem"),
    [
        ("use-distributed-optimizer: 3", "--use-distributed-optimizer is an on/off switch: give true or false, not 3"),
        ("offload-chunk-mb: big", "expected a number of MiB, such as 64 (the default), got 'big'"),
        ("offload-chunk-mb: true", "needs a value; true and false are for on/off switches"),
    ],
)
def test_a_bad_value_in_a_config_file_names_the_file_and_the_key(
    megatron: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    yaml_line: str,
    problem: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = tmp_path / "run.yaml"
    config.write_text(f"{yaml_line}\n")
    key = yaml_line.split(":")[0]
    # In Megatron's own parser (our script, or the launcher's run of a script) ...
    with pytest.raises(SystemExit):
        parse_and_validate(megatron, monkeypatch, *expand_config_argv(["--config", str(config)]))
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"megatron-offload: --config {config}, key {key}: {problem}"
    # ... and in the launcher's check, before any script runs.
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    assert run.main([str(script), "--config", str(config)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"megatron-offload: --config {config}, key {key}: {problem}"


def test_the_same_flag_on_the_command_line_is_named_as_argparse_names_it(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = tmp_path / "run.yaml"
    config.write_text("offload-chunk-mb: 32\n")
    with pytest.raises(SystemExit):
        argv = expand_config_argv(["--config", str(config), "--offload-gpu-memory-cap-gib", "abc"])
        parse_and_validate(megatron, monkeypatch, *argv)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "pretrain_gpt.py: error: argument --offload-gpu-memory-cap-gib: expected a number of GiB, the GPU memory "
        "to imitate, such as 20, got 'abc' (--help lists the flags)"
    )


def test_chunked_loss_on_a_megatron_core_without_output_processor_is_refused_in_validation(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the model is built, in one line (the version probe is stood in: the CPU venv's megatron-core
    may be either side of 0.19)."""
    from megatron_offload.megatron import long_context_adapter

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron_training, "supports_output_processor", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, "--chunked-loss")
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert line == f"megatron-offload: {long_context_adapter.CHUNKED_LOSS_NEEDS}"
