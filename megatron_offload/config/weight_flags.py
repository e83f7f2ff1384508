"""The weight-streaming flag and the combinations it supports, checked before anything is built.

Weight streaming brings each transformer layer's weights to the GPU around its uses and sends its
gradients back after its backward. That is correct only where each layer's weights are needed once in
the forward and once in its backward (full recompute of one layer at a time), where gradients reach
``main_grad`` through megatron-core's DDP hook (no fused accumulation inside the GEMM), and where no
collective or graph reads the buffers behind the streaming's back. Everything else is refused here in
one line naming the flag and what to do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_offload.config.refusals import (
    CUDA_GRAPHS,
    Check,
    changed_flags,
    is_not,
    is_other_than,
    on,
    over_one,
    refuse,
    set_,
)

__all__ = [
    "ORDERS",
    "STEP_MODES",
    "TIED_REFUSAL",
    "WeightConfig",
    "add_weight_args",
    "backward_order",
    "check_weight_flags",
    "ignored_weight_flags",
    "weight_config_from_args",
]

FLAG = "--offload-weights"
STEP_FLAG = "--offload-weights-step"
STEP_MODES = ("streamed", "megatron")
ORDER_FLAG = "--offload-weights-order"
SLOTS_FLAG = "--offload-weights-slots"
ORDERS = ("auto", "layer", "micro-batch")
TIED_REFUSAL = (
    f"{ORDER_FLAG} layer needs untied embeddings (the shared weight's gradient would sum in another order): add "
    f"--untie-embeddings-and-output-weights, or use {ORDER_FLAG} micro-batch"
)


@dataclass(frozen=True)
class WeightConfig:
    """Weight streaming as the flags ask for it, read once after validation."""

    enabled: bool = False
    """Stream every transformer layer's weights and gradients from host memory."""
    step: str = "streamed"
    """The optimizer step: "streamed" (one pass over host memory) or "megatron" (megatron-core's own
    passes, for comparison)."""
    order: str = "micro-batch"
    """The backward's order, as decided: "layer" (each layer's backwards for every micro-batch in a row,
    the layer brought in once) or "micro-batch" (the loop's own order)."""
    why: str = ""
    """Why that order, for the log."""
    weight_slots: int = 3
    """GPU buffers the streamed layers' weights take turns in (two on their way while one computes; more keep
    layers on the GPU between micro-batches)."""

    def __post_init__(self) -> None:
        if self.step not in STEP_MODES:
            raise ValueError(f"{STEP_FLAG} must be one of {', '.join(STEP_MODES)}; got {self.step!r}")
        if self.order not in ORDERS[1:]:
            raise ValueError(f"{ORDER_FLAG} decides between {', '.join(ORDERS[1:])}; got {self.order!r}")
        if self.weight_slots < 2:
            raise ValueError(
                f"{SLOTS_FLAG} needs at least 2 (one layer computing, the next arriving); got {self.weight_slots}"
            )

    @property
    def layer_major(self) -> bool:
        return self.enabled and self.order == "layer"

    @property
    def streamed_step(self) -> bool:
        return self.enabled and self.step == "streamed"


def backward_order(args: argparse.Namespace) -> tuple[str, str]:
    """The backward's order ``--offload-weights-order`` asks for, and why. "auto" takes the layer order where
    it is bitwise (untied embeddings) and costs no GPU memory (layer inputs in host memory: the layer order
    keeps every micro-batch's until the backward)."""
    asked = getattr(args, "offload_weights_order", "auto") or "auto"
    if asked != "auto":
        return asked, f"{ORDER_FLAG} {asked}"
    if not getattr(args, "untie_embeddings_and_output_weights", False):
        return "micro-batch", "tied embeddings; the layer order needs --untie-embeddings-and-output-weights"
    if not getattr(args, "offload_layer_inputs", False):
        return "micro-batch", "layer inputs on the GPU; the layer order needs --offload-layer-inputs"
    return "layer", "untied embeddings, layer inputs in host memory"


def ignored_weight_flags(args: argparse.Namespace) -> list[str]:
    """The weight-streaming flags given a value other than their default without --offload-weights, where they
    do nothing."""
    if getattr(args, "offload_weights", False):
        return []
    return changed_flags(
        args, {"offload_weights_order": "auto", "offload_weights_slots": 3, "offload_weights_step": "streamed"}
    )


def weight_config_from_args(args: argparse.Namespace) -> WeightConfig:
    """The weight-streaming settings of parsed (and validated) arguments."""
    order, why = backward_order(args)
    return WeightConfig(
        bool(getattr(args, "offload_weights", False)),
        getattr(args, "offload_weights_step", "streamed"),
        order,
        why,
        getattr(args, "offload_weights_slots", 3),
    )


def add_weight_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        FLAG,
        action="store_true",
        help="Keep every transformer layer's weights and gradients in host memory and stream them through "
        "a few GPU slots, layer by layer (with --offload-optimizer-states, one GPU, and --recompute-granularity "
        "full --recompute-method uniform --recompute-num-layers 1): trains models whose weights, gradients "
        "and optimizer state do not fit the GPU. The embedding and output layer stay on the GPU.",
    )
    group.add_argument(
        ORDER_FLAG,
        choices=ORDERS,
        default="auto",
        help="The order of the backward with --offload-weights. layer: every micro-batch's backward of a layer "
        "runs in a row, so each layer comes to the GPU once for its forward per micro-batch and once for all its "
        "backwards, and its gradients leave once per step (bitwise equal; needs "
        "--untie-embeddings-and-output-weights; keeps every micro-batch's layer inputs until the backward, in "
        "host memory with --offload-layer-inputs). micro-batch: the training loop's own order. auto (default): "
        "layer where it is untied and the layer inputs go to host memory.",
    )
    group.add_argument(
        SLOTS_FLAG,
        type=int,
        default=3,
        metavar="N",
        help="GPU slots for the streamed layers' weights, each as large as the largest layer's bf16 weights "
        "(default 3: one layer computing, two on their way). More slots keep layers on the GPU between "
        "micro-batches, the one needed last giving way first: each costs one layer's weights of GPU memory and "
        "saves up to one copy of a layer per micro-batch.",
    )
    # Hidden: megatron-core's own step passes over host memory, to compare the streamed step against.
    group.add_argument(STEP_FLAG, choices=STEP_MODES, default="streamed", help=argparse.SUPPRESS)


# (argument name, is it unsupported?, what to tell the user)
_AS_GIVEN: list[Check] = [
    ("tensor_model_parallel_size", over_one, "streams on one GPU only for now; set it to 1"),
    ("pipeline_model_parallel_size", over_one, "streams on one GPU only for now; set it to 1"),
    ("context_parallel_size", over_one, "streams on one GPU only for now; set it to 1"),
    ("expert_model_parallel_size", over_one, "streams on one GPU only for now; set it to 1"),
    ("num_experts", set_, "does not stream MoE expert weights yet; drop it"),
    ("recompute_granularity", is_not("full"), "needs --recompute-granularity full"),
    ("recompute_method", is_not("uniform"), "needs --recompute-method uniform"),
    ("recompute_num_layers", is_not(1), "needs --recompute-num-layers 1 (one layer's weights on the GPU at a time)"),
    ("overlap_grad_reduce", on, "cannot overlap the gradient reduce with backward: drop it"),
    ("overlap_param_gather", on, "cannot overlap the parameter gather: drop it"),
    ("fp16", on, "supports --bf16 (or fp32) training only: use --bf16"),
    ("fp8", set_, "does not support fp8 yet: drop it"),
    ("fp4", set_, "does not support fp4 yet: drop it"),
    *CUDA_GRAPHS,
    ("cpu_offloading", on, "and activation offloading (--cpu-offloading) cannot be combined: drop it"),
    ("num_layers_per_virtual_pipeline_stage", set_, "streams on one GPU only for now: drop it"),
    ("init_model_with_meta_device", on, "builds the model in host memory itself: drop it"),
    (
        "transformer_impl",
        is_other_than("local"),
        "streams megatron-core's local layers only (TransformerEngine's keep weight caches and accumulate weight "
        "gradients inside their GEMMs): use --transformer-impl local",
    ),
]


def check_weight_flags(args: argparse.Namespace, state_offload: bool, derived: bool = False) -> None:
    """Raise ValueError, one line naming the flag and what to do, for a combination weight streaming does
    not support. ``state_offload``: whether --offload-optimizer-states asked for our offloader.
    ``derived``: also the values Megatron's validation derives (data-parallel size, whether
    gradient-accumulation fusion stayed on), after that validation."""
    if not getattr(args, "offload_weights", False):
        return
    if not state_offload:
        raise ValueError(
            f"{FLAG} needs --offload-optimizer-states (the optimizer state of a model too large for the GPU "
            "must leave it too): add --offload-optimizer-states"
        )
    refuse(args, FLAG, _AS_GIVEN)
    if (getattr(args, "offload_weights_slots", 3) or 0) < 2:
        raise ValueError(
            f"{SLOTS_FLAG} {args.offload_weights_slots} is too few: give 2 or more (one layer computing, the next "
            "arriving)"
        )
    if getattr(args, "offload_weights_order", "auto") == "layer" and not getattr(
        args, "untie_embeddings_and_output_weights", False
    ):
        raise ValueError(TIED_REFUSAL)
    if not derived:
        return
    if (getattr(args, "data_parallel_size", 1) or 1) > 1 or (getattr(args, "world_size", 1) or 1) > 1:
        raise ValueError(
            f"{FLAG} streams on one GPU only for now (got {getattr(args, 'world_size', '?')} ranks): run one "
            "process (--nproc-per-node 1); docs/weight-streaming.md says how data parallelism will work"
        )
    if getattr(args, "gradient_accumulation_fusion", False):
        raise ValueError(
            f"{FLAG} needs gradients accumulated by megatron-core's DDP hook, not inside the GEMM: add "
            "--no-gradient-accumulation-fusion"
        )
