"""The long-context flags: what they refuse, each in one line naming the flag and what to do, and the host
bytes the layer inputs take (what the start-up host-memory check counts)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from megatron_offload import add_offload_args
from megatron_offload.config.flag_checks import check_offload_combinations
from megatron_offload.config.long_context_flags import (
    SDPA_SPEC,
    LongContextConfig,
    layer_input_bytes_per_rank,
    long_context_config_from_args,
)

FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def parse(*argv: str, **megatron: object) -> argparse.Namespace:
    args = add_offload_args(argparse.ArgumentParser()).parse_args(list(argv))
    for name, value in {**FULL, "optimizer": "adam", **megatron}.items():
        setattr(args, name, value)
    return args


def test_the_supported_combinations_pass() -> None:
    check_offload_combinations(parse("--offload-layer-inputs", "--chunked-loss", "--chunked-loss-tokens", "512"))
    args = parse("--offload-layer-inputs", spec=SDPA_SPEC, create_attention_mask_in_dataloader=False)
    check_offload_combinations(args)


@pytest.mark.parametrize(
    ("argv", "megatron", "named"),
    [
        (["--offload-layer-inputs"], {"recompute_granularity": None}, r"add --recompute-granularity full"),
        (["--offload-layer-inputs"], {"recompute_granularity": "selective"}, r"--recompute-granularity selective"),
        (["--offload-layer-inputs"], {"distribute_saved_activations": True}, r"--distribute-saved-activations"),
        (["--offload-layer-inputs"], {"fp8": "hybrid"}, r"does not support fp8"),
        (["--offload-layer-inputs"], {"cpu_offloading": True}, r"--cpu-offloading"),
        (["--offload-layer-inputs"], {"cuda_graph_impl": "local"}, r"CUDA graphs.*--cuda-graph-impl local"),
        ([], {"spec": SDPA_SPEC, "softmax_type": "off-by-one"}, r"use vanilla.*--softmax-type off-by-one"),
        (["--chunked-loss"], {"tensor_model_parallel_size": 2}, r"--tensor-model-parallel-size 2"),
        (["--chunked-loss"], {"mtp_num_layers": 1}, r"--mtp-num-layers"),
        (["--chunked-loss"], {"cross_entropy_loss_fusion": True}, r"drop --cross-entropy-loss-fusion"),
        ([], {"spec": SDPA_SPEC, "create_attention_mask_in_dataloader": True}, r"--no-create-attention-mask"),
        ([], {"spec": SDPA_SPEC, "context_parallel_size": 2}, r"--context-parallel-size 2"),
        (["--chunked-loss-tokens", "64"], {}, r"add --chunked-loss or drop it"),
        (["--chunked-loss", "--chunked-loss-tokens", "0"], {}, r"positive number of tokens, got 0"),
    ],
)
def test_each_refusal_names_the_flag_and_what_to_do(argv: list[str], megatron: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named) as refused:
        check_offload_combinations(parse(*argv, **megatron))
    assert "\n" not in str(refused.value)


def test_the_launcher_refuses_before_megatron_starts(tmp_path) -> None:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script ran')\n")
    result = subprocess.run(
        [sys.executable, "-m", "megatron_offload.run", str(script), "--chunked-loss", "--chunked-loss-tokens", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "--chunked-loss-tokens must be a positive number of tokens, got -1" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_layer_input_host_bytes() -> None:
    args = parse("--offload-layer-inputs", num_layers=36, seq_length=65536, micro_batch_size=1, hidden_size=3072)
    args.bf16 = True
    # 36 inputs of 65,536 x 3,072 bf16: the 13.5 GB the measured run pinned (13.12 GiB with the pass's last kept)
    assert layer_input_bytes_per_rank(args) == 36 * 65536 * 3072 * 2
    args.recompute_num_layers = 4  # one input per checkpointed chunk of four layers
    assert layer_input_bytes_per_rank(args) == 9 * 65536 * 3072 * 2
    args.recompute_method, args.recompute_num_layers = "block", 10  # only the first ten layers are checkpointed
    assert layer_input_bytes_per_rank(args) == 10 * 65536 * 3072 * 2
    assert layer_input_bytes_per_rank(parse(num_layers=36, seq_length=65536, hidden_size=3072)) == 0


def test_the_config_is_read_once_from_the_parsed_flags() -> None:
    args = parse("--offload-layer-inputs", "--chunked-loss", "--chunked-loss-tokens", "512")
    config = long_context_config_from_args(args)
    assert config == LongContextConfig(layer_inputs=True, chunked_loss=True, chunk_tokens=512) and config.wanted
    assert not long_context_config_from_args(parse()).wanted
