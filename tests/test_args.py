"""Flags and validation rules: everything here runs without a GPU or megatron-core."""

import argparse

import pytest

from megatron_offload import OffloadConfig, PrefetchPolicy, add_offload_args, config_from_args, validate_offload_args


def megatron_like_args(**overrides: object) -> argparse.Namespace:
    """A namespace with the Megatron-LM attributes validation reads, set to a combination that works."""
    values = {
        "offload_optimizer_states": True,
        "optimizer_cpu_offload": False,
        "use_distributed_optimizer": True,
        "optimizer": "adam",
        "use_megatron_fsdp": False,
        "use_torch_fsdp2": False,
        "optimizer_cuda_graph": False,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


def test_defaults_and_returned_parser() -> None:
    parser = argparse.ArgumentParser()
    assert add_offload_args(parser) is parser
    args = parser.parse_args([])
    assert args.offload_optimizer_states is False
    assert args.offload_master_weights is True
    assert args.offload_prefetch == "auto"
    assert args.offload_chunk_mb == 64.0 and args.offload_fraction == 1.0
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


def test_config_names_the_flag_for_a_bad_policy() -> None:
    with pytest.raises(ValueError, match="--offload-prefetch='never'.*finalize, step"):
        OffloadConfig(prefetch="never")
    assert OffloadConfig(prefetch="step").prefetch is PrefetchPolicy.STEP


def test_parser_that_already_has_the_flag_gets_a_clear_error() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--offload-optimizer-states", action="store_true")
    with pytest.raises(ValueError, match="already defines --offload-optimizer-states"):
        add_offload_args(parser)


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
