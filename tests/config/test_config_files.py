"""``--config`` files as a YAML user writes them, and the check train.sh runs before torchrun: every
problem one line naming the file, the key or the flag."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_offload import add_offload_args
from megatron_offload.config.files import (
    NO_CUDA,
    add_switch_inverses,
    expand_config_argv,
    missing_training_message,
    preflight,
)

ROOT = Path(__file__).resolve().parents[2]


def megatron_like_parser() -> argparse.ArgumentParser:
    """Switches spelled as Megatron-LM spells them, plus ours."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--no-persist-layer-norm", action="store_true")
    parser.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion")
    parser.add_argument("--lr", type=float)
    return add_switch_inverses(add_offload_args(parser))


def parse_config(tmp_path: Path, text: str) -> argparse.Namespace:
    (tmp_path / "run.yaml").write_text(text)
    return megatron_like_parser().parse_args(expand_config_argv(["--config", str(tmp_path / "run.yaml")]))


@pytest.mark.parametrize(
    ("text", "attribute", "value"),
    [
        ("use-distributed-optimizer: false\n", "use_distributed_optimizer", False),
        ("use-distributed-optimizer: true\n", "use_distributed_optimizer", True),
        ("bf16: no\n", "bf16", False),
        ("no-persist-layer-norm: false\n", "no_persist_layer_norm", False),
        ("persist-layer-norm: false\n", "no_persist_layer_norm", True),
        ("masked-softmax-fusion: false\n", "masked_softmax_fusion", False),
        ("masked_softmax_fusion: true\n", "masked_softmax_fusion", True),
        ("no-masked-softmax-fusion: false\n", "masked_softmax_fusion", True),
        ("offload-master-weights: false\n", "offload_master_weights", False),
        ("lr: -1.0e-4\n", "lr", -1e-4),
    ],
)
def test_false_turns_a_switch_off_whichever_way_megatron_spells_it(
    tmp_path: Path, text: str, attribute: str, value: object
) -> None:
    assert getattr(parse_config(tmp_path, text), attribute) == value


def test_the_command_line_still_wins_over_the_file(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("use-distributed-optimizer: false\n")
    argv = expand_config_argv(["--config", str(tmp_path / "run.yaml"), "--use-distributed-optimizer"])
    assert megatron_like_parser().parse_args(argv).use_distributed_optimizer is True


def test_inverses_are_hidden_from_help() -> None:
    text = megatron_like_parser().format_help()
    assert "--use-distributed-optimizer" in text and "--no-use-distributed-optimizer" not in text


def test_a_value_given_to_a_switch_is_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_config(tmp_path, "bf16: yes please\n")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "pretrain_gpt.py: error: argument --bf16: ignored explicit argument 'yes please'"


def test_malformed_yaml_is_one_line_naming_the_file_and_the_place(tmp_path: Path) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text("num-layers: 4\nhidden-size: [512\nlr: 1\n")
    with pytest.raises(ValueError) as error:
        expand_config_argv(["--config", str(config)])
    message = str(error.value)
    assert message.startswith(f"--config {config}: not valid YAML at line ")
    assert "\n" not in message and "<unicode string>" not in message
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_the_preflight_names_a_missing_or_bad_config_file(tmp_path: Path) -> None:
    assert preflight(["--config", "nope.yaml"]) == (
        "megatron-offload: --config nope.yaml: no such file (see configs/ for the shipped ones)"
    )
    (tmp_path / "list.yaml").write_text("- a\n")
    assert preflight(["--config", str(tmp_path / "list.yaml")]) == (
        f"megatron-offload: --config {tmp_path / 'list.yaml'}: expected a mapping of Megatron flag names to values"
    )


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the Python 3.11 message")
def test_missing_megatron_training_on_python_311_says_it_needs_312() -> None:
    message = missing_training_message()
    assert "megatron-core wheels ship it from 0.17 on" in message
    assert "which requires Python >= 3.12; this is Python 3.11." in message
    assert "PYTHON=python3.12 bash scripts/train.sh" in message and "attach_offloader" in message
    assert "\n" not in message


def test_the_preflight_stops_on_a_machine_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "megatron.training" else real_find_spec(name, *a),
    )
    assert preflight(["--config", str(ROOT / "configs" / "tiny.yaml")]) == NO_CUDA


def test_the_preflight_command_prints_one_line_and_exits_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "megatron_offload.config.files", "--config", "nope.yaml", "--bf16"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "megatron-offload: --config nope.yaml: no such file (see configs/ for the shipped ones)\n"
