"""The checks on values, without a GPU or megatron-core: chunk size, fraction ('auto' or a number from 0
to 1) and GPU memory cap, refused alike from the flags, a ``--config`` file and the Python API (each in its
own names), before anything is built and with offloading off too."""

from __future__ import annotations

import argparse

import pytest

from megatron_offload import OffloadConfig, add_offload_args, config_from_args, validate_offload_args
from megatron_offload.core.units import GIB
from tests.config.megatron_args import megatron_like_args

BAD_VALUES = [
    ("--offload-chunk-mb", "0"),
    ("--offload-chunk-mb", "-1"),
    ("--offload-chunk-mb", "nan"),
    ("--offload-chunk-mb", "inf"),
    ("--offload-fraction", "1.5"),
    ("--offload-fraction", "-1"),
    ("--offload-fraction", "nan"),
    ("--offload-gpu-memory-cap-gib", "0"),
    ("--offload-gpu-memory-cap-gib", "-2"),
    ("--offload-gpu-memory-cap-gib", "nan"),
]


def parsed(*argv: str) -> argparse.Namespace:
    """Our flags parsed from ``argv``, on top of a Megatron-like namespace that validates."""
    flags = add_offload_args(argparse.ArgumentParser()).parse_args(["--offload-optimizer-states", *argv])
    return megatron_like_args(**vars(flags))


@pytest.mark.parametrize(("flag", "value"), BAD_VALUES)
def test_validation_rejects_bad_values_before_anything_is_built(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{flag} must be (a positive|'auto' or a) number"):
        validate_offload_args(parsed(flag, value))


def test_the_python_api_and_the_flags_say_the_same_each_in_its_own_names() -> None:
    for field, flag, value in (
        ("chunk_mb", "--offload-chunk-mb", 0.0),
        ("fraction", "--offload-fraction", 1.5),
        ("gpu_memory_cap_gib", "--offload-gpu-memory-cap-gib", -2.0),
    ):
        with pytest.raises(ValueError) as from_api:
            OffloadConfig(**{field: value})
        with pytest.raises(ValueError) as from_flags:
            validate_offload_args(parsed(flag, str(value)))
        assert str(from_api.value).startswith(f"OffloadConfig.{field} must be ") and flag not in str(from_api.value)
        assert str(from_flags.value) == str(from_api.value).replace(f"OffloadConfig.{field}", flag)


def test_an_unknown_setting_is_named_with_the_nearest_one() -> None:
    with pytest.raises(TypeError) as error:
        OffloadConfig().with_changes(chunkmb=32)
    assert str(error.value).startswith("'chunkmb' is not an offload setting (did you mean 'chunk_mb'?); the settings: ")
    assert OffloadConfig().with_changes(chunk_mb=32) == OffloadConfig(chunk_mb=32)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "20", True])
def test_the_python_api_refuses_a_cap_that_is_not_a_positive_number(value: object) -> None:
    with pytest.raises(ValueError, match=r"^OffloadConfig.gpu_memory_cap_gib must be a positive number of GiB"):
        OffloadConfig(gpu_memory_cap_gib=value)


def test_no_cap_is_the_default_and_a_cap_is_kept_in_gib_and_bytes() -> None:
    assert OffloadConfig().gpu_memory_cap_gib is None and OffloadConfig().gpu_memory_cap_bytes is None
    assert OffloadConfig(gpu_memory_cap_gib=20).gpu_memory_cap_bytes == 20 * GIB
    assert OffloadConfig(gpu_memory_cap_gib=0.5).gpu_memory_cap_bytes == GIB // 2


@pytest.mark.parametrize("value", ["64", True, None, [1]])
def test_the_python_api_refuses_values_of_the_wrong_type(value: object) -> None:
    with pytest.raises(ValueError, match="^OffloadConfig.chunk_mb must be a positive number"):
        OffloadConfig(chunk_mb=value)
    with pytest.raises(ValueError, match="OffloadConfig.pin_memory must be true or false"):
        OffloadConfig(pin_memory="yes")


def test_the_cap_is_checked_with_offloading_off_too() -> None:
    args = add_offload_args(argparse.ArgumentParser()).parse_args(["--offload-gpu-memory-cap-gib", "-1"])
    with pytest.raises(ValueError, match="--offload-gpu-memory-cap-gib"):
        validate_offload_args(args)
    args = add_offload_args(argparse.ArgumentParser()).parse_args(["--offload-gpu-memory-cap-gib", "24"])
    validate_offload_args(args)
    assert args.offload_gpu_memory_cap_gib == 24.0
    assert config_from_args(args) == OffloadConfig(gpu_memory_cap_gib=24.0)
    assert config_from_args(args).gpu_memory_cap_bytes == 24 * GIB


@pytest.mark.parametrize(
    ("yaml_line", "expected"),
    [
        ("offload-fraction: 1.5", "--offload-fraction must be 'auto' or a number from 0"),
        ("offload-fraction: half", "argument --offload-fraction: expected 'auto' or a number from 0 to 1, got 'half'"),
        ("offload-chunk-mb: -4", "--offload-chunk-mb must be a positive number"),
        ("offload-chunk-mb: abc", "argument --offload-chunk-mb: expected a number of MiB, such as 64 (the default)"),
        ("offload-chunk-mb: true", "argument --offload-chunk-mb: expected one argument"),
    ],
)
def test_a_config_file_gets_the_same_checks(
    tmp_path, capsys: pytest.CaptureFixture[str], yaml_line: str, expected: str
) -> None:
    from megatron_offload.config.files import expand_config_argv

    (tmp_path / "run.yaml").write_text(f"offload-optimizer-states: true\n{yaml_line}\n")
    parser = add_offload_args(argparse.ArgumentParser())
    argv = expand_config_argv(["--config", str(tmp_path / "run.yaml")])
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        assert expected in capsys.readouterr().err  # argparse names the flag and the value
        return
    with pytest.raises(ValueError, match=expected):
        validate_offload_args(megatron_like_args(**vars(args)))


FRACTION_MESSAGE = (
    "--offload-fraction must be 'auto' or a number from 0 (offload nothing) to 1 (offload all); 'auto', the "
    "default, keeps what fits; got {}"
)


@pytest.mark.parametrize("text", ["auto", "AUTO", " auto "])
def test_fraction_auto_from_the_flag_reaches_the_config(text: str) -> None:
    args = add_offload_args(argparse.ArgumentParser()).parse_args(
        ["--offload-optimizer-states", "--offload-fraction", text]
    )
    assert args.offload_fraction == "auto"
    validate_offload_args(megatron_like_args(**vars(args)))
    assert config_from_args(args) == OffloadConfig(fraction="auto")
    assert config_from_args(args).fraction == "auto"


def test_fraction_auto_from_a_config_file(tmp_path) -> None:
    from megatron_offload.config.files import expand_config_argv

    (tmp_path / "run.yaml").write_text("offload-optimizer-states: true\noffload-fraction: auto\n")
    argv = expand_config_argv(["--config", str(tmp_path / "run.yaml")])
    args = add_offload_args(argparse.ArgumentParser()).parse_args(argv)
    assert config_from_args(args).fraction == "auto"


def test_fraction_numbers_still_parse_and_the_default_is_auto() -> None:
    parser = add_offload_args(argparse.ArgumentParser())
    assert parser.parse_args(["--offload-fraction", "0.5"]).offload_fraction == 0.5
    assert parser.parse_args([]).offload_fraction == "auto" and OffloadConfig().fraction == "auto"


def test_a_bad_fraction_word_is_one_line_naming_the_flag_and_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        add_offload_args(argparse.ArgumentParser(prog="train")).parse_args(["--offload-fraction", "most"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "train: error: argument --offload-fraction: expected 'auto' or a number from 0 to 1, got 'most'"


@pytest.mark.parametrize("value", ["Auto!", "", 2, -0.5, True, None])
def test_the_python_api_refuses_a_fraction_that_is_neither_auto_nor_in_range(value: object) -> None:
    with pytest.raises(ValueError) as error:
        OffloadConfig(fraction=value)
    expected = FRACTION_MESSAGE.format(repr(value)).replace("--offload-fraction", "OffloadConfig.fraction")
    assert str(error.value) == expected


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--offload-fraction", "2", FRACTION_MESSAGE.format("2.0")),
        ("--offload-chunk-mb", "0", "--offload-chunk-mb must be a positive number of MiB (the default is 64), got 0.0"),
    ],
)
def test_out_of_range_values_are_refused_with_offloading_off_too(flag: str, value: str, message: str) -> None:
    args = add_offload_args(argparse.ArgumentParser()).parse_args([flag, value])
    assert args.offload_optimizer_states is False
    with pytest.raises(ValueError) as error:
        validate_offload_args(args)
    assert str(error.value) == message
