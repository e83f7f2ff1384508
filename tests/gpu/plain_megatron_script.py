"""A Megatron-LM training script that makes no call to megatron-offload: it parses Megatron's own
flags and runs Megatron's own loop. ``python -m megatron_offload.run`` must make it offload-aware;
run plainly, it must reject --offload-optimizer-states as an unknown flag.

It borrows the batch, loss and mock-data functions of scripts/pretrain_gpt.py.
"""

import runpy
from pathlib import Path

PRETRAIN_GPT = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "pretrain_gpt.py"))

from megatron.core.enums import ModelType  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402

if __name__ == "__main__":
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    datasets, forward_step = PRETRAIN_GPT["train_valid_test_datasets_provider"], PRETRAIN_GPT["forward_step"]
    pretrain(config, datasets, ModelType.encoder_or_decoder, forward_step)
