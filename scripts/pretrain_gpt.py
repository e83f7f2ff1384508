# ruff: noqa: E402  (megatron.training is imported only after checking that it exists)
"""GPT pretraining on Megatron-LM's own training loop, with megatron-offload's flags.

Megatron builds the model (GPTModelBuilder), the optimizer and the data loaders and runs its loop
(``megatron.training.training.pretrain``); this script only supplies the batch, the loss and the
datasets (megatron-core's MockGPTDataset with ``--mock-data``, GPTDataset with ``--data-path``).
It accepts Megatron's flags, ours (``--offload-optimizer-states`` ...) and ``--config FILE.yaml``:

    torchrun --standalone --nproc-per-node 1 scripts/pretrain_gpt.py --config configs/tiny.yaml \
        --offload-optimizer-states
    torchrun --standalone --nproc-per-node 2 scripts/pretrain_gpt.py --config configs/gpt_tp2.yaml

Needs megatron-core >= 0.17 (the wheels that ship megatron.training); checked against 0.19.2.
"""

import importlib.metadata
import importlib.util
import re
import sys
from functools import partial
from pathlib import Path


def _require_megatron_training() -> None:
    try:
        present = importlib.util.find_spec("megatron.training") is not None
    except ImportError:  # no megatron package at all
        present = False
    if present:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatron_offload.config.files import missing_training_message

    print(f"megatron-offload: {missing_training_message()}", file=sys.stderr)
    sys.exit(2)


_require_megatron_training()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_offload without pip install

from megatron_offload.config.files import expand_config_argv

try:
    sys.argv[1:] = expand_config_argv(sys.argv[1:])
except (OSError, ValueError) as error:  # a missing or malformed --config file: one line, no traceback
    sys.exit(f"megatron-offload: {error}")

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, get_timers, get_tokenizer, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.training import pretrain
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

import megatron_offload
from megatron_offload.megatron.optimizer_adapter import OffloadFitError  # noqa: E402
from megatron_offload.megatron.out_of_memory import line_for
from megatron_offload.megatron.training_hooks import install_training_hooks


def get_batch(data_iterator, vp_stage=None):
    """tokens, labels, loss_mask, attention_mask, position_ids: read on TP rank 0, broadcast to the rest."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {key: value.cuda(non_blocking=True) for key, value in next(data_iterator).items()}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed token loss, its token count, and Megatron's ``[sum, count]`` report for the log line."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets ({dataset_type.__name__}) ...")

    def is_built_on_rank():  # TP rank 0 of the stages that read data; get_batch broadcasts to the rest
        return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, is_built_on_rank, config).build()


# The builder is distributed-aware (every rank calls it), so Megatron must call the provider on every rank.
train_valid_test_datasets_provider.is_distributed = True


def check_without_transformer_engine(args) -> None:
    """Name the flags a run without TransformerEngine or apex needs, before Megatron fails deep inside."""
    have_te = importlib.util.find_spec("transformer_engine") is not None
    local = args.transformer_impl == "local" or not have_te

    def missing(module: str) -> bool:
        return importlib.util.find_spec(module) is None

    needed = {
        "--transformer-impl local": args.transformer_impl == "transformer_engine" and not have_te,
        "--no-persist-layer-norm": local and not args.no_persist_layer_norm and missing("apex"),
        "--no-gradient-accumulation-fusion": local
        and args.gradient_accumulation_fusion
        and missing("fused_weight_gradient_mlp_cuda"),
        "--no-masked-softmax-fusion": local and args.masked_softmax_fusion and missing("scaled_masked_softmax_cuda"),
        "--no-rope-fusion": args.apply_rope_fusion and not have_te,
    }
    flags = [flag for flag, is_needed in needed.items() if is_needed]
    if flags:
        sys.exit(
            f"megatron-offload: TransformerEngine/apex kernels are not installed here; add {' '.join(flags)} "
            "(the configs/*.yaml files carry these flags)."
        )


def add_args(parser):
    """Our flags. Also escapes the bare '%' of a megatron-core 0.19.2 help text, which breaks --help."""
    parser = megatron_offload.add_offload_args(parser)
    for action in parser._actions:
        if action.help:
            action.help = re.sub(r"%%|%\(\w+\)\w|%", lambda m: m[0] if len(m[0]) > 1 else "%%", action.help)
    return parser


def main() -> None:
    install_training_hooks()
    args = parse_and_validate_args(extra_args_provider=add_args, args_defaults={"tokenizer_type": "NullTokenizer"})
    check_without_transformer_engine(args)
    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    try:
        main()
    except OffloadFitError as error:  # a setting that cannot fit: one line, the state is whole on the host
        print(error, file=sys.stderr, flush=True)
        sys.exit(2)
    except torch.OutOfMemoryError as error:  # the numbers and what would move more off the GPU, in one line
        print(line_for(error), file=sys.stderr, flush=True)
        sys.exit(1)
