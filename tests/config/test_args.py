"""Flags and validation rules: the flags parsed into the config, the combinations with Megatron-LM's
flags that validation refuses or lets through, and our flags named as ignored without the switch.
Everything here runs without a GPU or megatron-core; the checks on values are test_values.py's."""

import argparse

import pytest

from megatron_offload import OffloadConfig, PrefetchPolicy, add_offload_args, config_from_args, validate_offload_args
from megatron_offload.config.flag_checks import check_offload_combinations, ignored_offload_flags
from tests.config.megatron_args import megatron_like_args


def test_defaults_and_returned_parser() -> None:
    parser = argparse.ArgumentParser()
    assert add_offload_args(parser) is parser
    args = parser.parse_args([])
    assert args.offload_optimizer_states is False
    assert args.offload_master_weights is True
    assert args.offload_prefetch == "auto"
    assert args.offload_chunk_mb == 64.0 and args.offload_fraction == "auto"
    assert args.offload_host_memory_check is True
    assert config_from_args(args) == OffloadConfig()


def test_flags_parse_into_config() -> None:
    args = add_offload_args(argparse.ArgumentParser()).parse_args(
        [
            "--offload-optimizer-states",
            "--no-offload-master-weights",
            "--offload-prefetch",
            "step",
            "--no-offload-host-memory-check",
            "--offload-chunk-mb",
            "16",
            "--offload-fraction",
            "0.25",
        ]
    )
    config = config_from_args(args)
    assert config == OffloadConfig(
        offload_master_weights=False,
        prefetch=PrefetchPolicy.STEP,
        check_host_memory=False,
        chunk_mb=16.0,
        fraction=0.25,
    )


@pytest.mark.parametrize(("flag", "value"), [("--offload-chunk-mb", "0"), ("--offload-fraction", "1.5")])
def test_bad_chunk_size_or_fraction_names_the_flag(flag: str, value: str) -> None:
    args = add_offload_args(argparse.ArgumentParser()).parse_args(["--offload-optimizer-states", flag, value])
    with pytest.raises(ValueError, match=flag):
        config_from_args(args)


def test_unknown_prefetch_policy_is_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        add_offload_args(argparse.ArgumentParser()).parse_args(["--offload-prefetch", "never"])


def test_the_python_api_names_the_field_for_a_bad_policy() -> None:
    with pytest.raises(ValueError, match=r"^OffloadConfig.prefetch must be one of auto, finalize, step; got 'never'$"):
        OffloadConfig(prefetch="never")
    assert OffloadConfig(prefetch="step").prefetch is PrefetchPolicy.STEP


def test_parser_that_already_has_the_flag_gets_ours_in_its_place() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--offload-optimizer-states", action="store_true")
    args = add_offload_args(parser).parse_args(["--offload-optimizer-states"])
    assert args.megatron_offload_optimizer_states is True and args.offload_optimizer_states is False


def test_valid_combination_passes() -> None:
    validate_offload_args(megatron_like_args())


def test_flag_off_accepts_anything() -> None:
    validate_offload_args(
        megatron_like_args(
            offload_optimizer_states=False,
            optimizer_cpu_offload=True,
            use_distributed_optimizer=False,
            optimizer="sgd",
            use_megatron_fsdp=True,
            optimizer_cuda_graph=True,
        )
    )
    validate_offload_args(argparse.Namespace())


def test_refuses_optimizer_cpu_offload_and_says_why() -> None:
    with pytest.raises(ValueError) as error:
        validate_offload_args(megatron_like_args(optimizer_cpu_offload=True))
    message = str(error.value)
    assert "--optimizer-cpu-offload" in message and "--offload-optimizer-states" in message
    assert "CPU" in message and "GPU" in message  # says what each one does


def test_requires_distributed_optimizer() -> None:
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        validate_offload_args(megatron_like_args(use_distributed_optimizer=False))
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        validate_offload_args(argparse.Namespace(offload_optimizer_states=True))


@pytest.mark.parametrize("optimizer", ["sgd", "muon", "lion"])
def test_requires_adam(optimizer: str) -> None:
    with pytest.raises(ValueError, match=f"--optimizer adam only, got --optimizer {optimizer}"):
        validate_offload_args(megatron_like_args(optimizer=optimizer))


@pytest.mark.parametrize(
    "attribute, flag",
    [
        ("use_megatron_fsdp", "--use-megatron-fsdp"),
        ("use_custom_fsdp", "--use-custom-fsdp"),
        ("use_torch_fsdp2", "--use-torch-fsdp2"),
        ("optimizer_cuda_graph", "--optimizer-cuda-graph"),
    ],
)
def test_refuses_fsdp_and_optimizer_cuda_graph(attribute: str, flag: str) -> None:
    with pytest.raises(ValueError, match=f"cannot be combined with {flag}"):
        validate_offload_args(megatron_like_args(**{attribute: True}))


def test_refuses_async_save_and_says_why() -> None:
    with pytest.raises(ValueError, match="--async-save.*host buffers"):
        validate_offload_args(megatron_like_args(async_save=True))


def test_the_early_check_refuses_cpu_offload_without_the_precision_aware_optimizer() -> None:
    """Megatron asserts that --optimizer-cpu-offload needs --use-precision-aware-optimizer; our refusal,
    which runs first, must not depend on that flag."""
    args = megatron_like_args(optimizer_cpu_offload=True, use_precision_aware_optimizer=False)
    with pytest.raises(ValueError) as error:
        check_offload_combinations(args)
    assert str(error.value).startswith("--offload-optimizer-states cannot be combined with --optimizer-cpu-offload. ")
    assert "pick one" in str(error.value)


def test_the_early_check_asks_for_the_distributed_optimizer_too() -> None:
    """Megatron turns it on by itself only with Megatron-FSDP, which is refused: the early check can ask."""
    with pytest.raises(ValueError, match="needs --use-distributed-optimizer"):
        check_offload_combinations(megatron_like_args(use_distributed_optimizer=False))
    with pytest.raises(ValueError, match="cannot be combined with --use-megatron-fsdp"):
        check_offload_combinations(megatron_like_args(use_distributed_optimizer=False, use_megatron_fsdp=True))


def test_offload_flags_without_the_switch_are_listed_as_ignored() -> None:
    parser = add_offload_args(argparse.ArgumentParser())
    assert ignored_offload_flags(parser.parse_args([])) == []
    assert ignored_offload_flags(parser.parse_args(["--offload-gpu-memory-cap-gib", "8"])) == []
    args = parser.parse_args(["--offload-fraction", "0.5", "--no-offload-master-weights", "--offload-prefetch", "step"])
    assert ignored_offload_flags(args) == ["--no-offload-master-weights", "--offload-prefetch", "--offload-fraction"]
    args = parser.parse_args(["--offload-optimizer-states", "--offload-fraction", "0.5"])
    assert ignored_offload_flags(args) == []
