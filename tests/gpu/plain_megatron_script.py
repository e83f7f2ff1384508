"""A Megatron-LM training script that makes no call to megatron-offload: it parses Megatron's own
flags and runs Megatron's own loop. ``python -m megatron_offload.run`` must make it offload-aware;
run plainly, it must reject --offload-optimizer-states as an unknown flag.

It borrows the batch, loss and mock-data functions of scripts/pretrain_gpt.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import pretrain_gpt  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402

if __name__ == "__main__":
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(
        config, pretrain_gpt.train_valid_test_datasets_provider, ModelType.encoder_or_decoder, pretrain_gpt.forward_step
    )
