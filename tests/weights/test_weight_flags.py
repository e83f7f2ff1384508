"""--offload-weights: the combinations it refuses, each in one line naming the flag and what to do."""

from __future__ import annotations

import argparse

import pytest

from megatron_offload import add_offload_args, validate_offload_args
from megatron_offload.config.flag_checks import check_offload_combinations
from megatron_offload.config.flags import config_from_args

SUPPORTED = [
    "--offload-optimizer-states",
    "--offload-weights",
]
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def parse(*argv: str, **megatron: object) -> argparse.Namespace:
    args = add_offload_args(argparse.ArgumentParser()).parse_args(list(argv))
    for name, value in {**RECOMPUTE, "optimizer": "adam", **megatron}.items():
        setattr(args, name, value)
    return args


def test_supported_combination_passes_and_keeps_masters_in_place() -> None:
    args = parse(*SUPPORTED, use_distributed_optimizer=True, data_parallel_size=1, world_size=1)
    validate_offload_args(args)
    # the masters are built in host memory already: the state offloader must not move them again
    assert config_from_args(args).offload_master_weights is False


def test_forgetting_the_state_flag_is_named() -> None:
    with pytest.raises(ValueError, match=r"--offload-weights needs --offload-optimizer-states"):
        check_offload_combinations(parse("--offload-weights", use_distributed_optimizer=True))


@pytest.mark.parametrize(
    ("megatron", "named"),
    [
        ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size 2"),
        ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 2"),
        ({"recompute_granularity": "selective"}, "--recompute-granularity selective"),
        ({"recompute_method": "block"}, "--recompute-method block"),
        ({"recompute_num_layers": 2}, "--recompute-num-layers 2"),
        ({"recompute_granularity": None}, "--recompute-granularity None"),
        ({"num_experts": 8}, "--num-experts 8"),
        ({"overlap_grad_reduce": True}, "--overlap-grad-reduce True"),
        ({"fp16": True}, "--fp16 True"),
        ({"fp8": "hybrid"}, "--fp8 hybrid"),
        ({"cuda_graph_impl": "local"}, "--cuda-graph-impl local"),
        ({"transformer_impl": "transformer_engine"}, "--transformer-impl transformer_engine"),
    ],
)
def test_unsupported_combinations_are_refused_before_anything_is_built(megatron: dict, named: str) -> None:
    args = parse(*SUPPORTED, use_distributed_optimizer=True, **megatron)
    with pytest.raises(ValueError) as error:
        check_offload_combinations(args)
    message = str(error.value)
    assert "--offload-weights" in message and named in message and "\n" not in message


@pytest.mark.parametrize(
    ("derived", "named"),
    [
        ({"data_parallel_size": 2, "world_size": 2}, "--nproc-per-node 1"),
        ({"gradient_accumulation_fusion": True}, "--no-gradient-accumulation-fusion"),
    ],
)
def test_values_megatron_derives_are_checked_after_its_validation(derived: dict, named: str) -> None:
    args = parse(*SUPPORTED, use_distributed_optimizer=True, **derived)
    check_offload_combinations(args)  # as given, nothing is wrong yet
    with pytest.raises(ValueError, match=named):
        validate_offload_args(args)


def test_the_launchers_early_check_of_our_flags_alone_passes() -> None:
    """Before Megatron's parser exists the launcher checks our flags on a namespace of ours only."""
    args = add_offload_args(argparse.ArgumentParser()).parse_args(["--offload-optimizer-states", "--offload-weights"])
    args.use_distributed_optimizer = True
    check_offload_combinations(args)


@pytest.mark.parametrize(
    ("argv", "megatron", "order"),
    [
        ([], {}, "micro-batch"),  # Megatron ties the embeddings by default
        ([], {"untie_embeddings_and_output_weights": True}, "micro-batch"),  # layer inputs would stay on the GPU
        (["--offload-layer-inputs"], {"untie_embeddings_and_output_weights": True}, "layer"),
        (
            ["--offload-layer-inputs", "--offload-weights-order", "micro-batch"],
            {"untie_embeddings_and_output_weights": True},
            "micro-batch",
        ),
        (["--offload-weights-order", "layer"], {"untie_embeddings_and_output_weights": True}, "layer"),
    ],
)
def test_auto_takes_the_layer_order_where_it_is_bitwise_and_costs_no_gpu_memory(argv, megatron, order) -> None:
    from megatron_offload.config.weight_flags import weight_config_from_args

    config = weight_config_from_args(parse(*SUPPORTED, *argv, **megatron))
    assert config.order == order and config.layer_major == (order == "layer") and config.why


def test_the_layer_order_with_tied_embeddings_is_refused_in_one_line() -> None:
    args = parse(*SUPPORTED, "--offload-weights-order", "layer", use_distributed_optimizer=True)
    with pytest.raises(ValueError) as error:
        check_offload_combinations(args)
    message = str(error.value)
    assert "--offload-weights-order layer" in message and "--untie-embeddings-and-output-weights" in message
    assert "\n" not in message
    args.untie_embeddings_and_output_weights = True
    check_offload_combinations(args)


def test_weight_slots_are_read_and_too_few_are_refused_in_one_line() -> None:
    from megatron_offload.config.weight_flags import weight_config_from_args

    assert weight_config_from_args(parse(*SUPPORTED, "--offload-weights-slots", "12")).weight_slots == 12
    assert weight_config_from_args(parse(*SUPPORTED)).weight_slots == 3
    args = parse(*SUPPORTED, "--offload-weights-slots", "1", use_distributed_optimizer=True)
    with pytest.raises(ValueError) as error:
        check_offload_combinations(args)
    assert "--offload-weights-slots 1" in str(error.value) and "\n" not in str(error.value)
