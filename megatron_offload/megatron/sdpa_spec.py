"""Attention whose memory grows with the sequence, not its square, without TransformerEngine: megatron-core's
local layer spec with its core attention on PyTorch's ``scaled_dot_product_attention``.

Megatron-LM takes it the way it takes any layer spec::

    --spec megatron_offload.megatron.sdpa_spec gpt_layer_spec

(``gpt_builders.py`` imports the named object and builds every ``TransformerLayer`` from it). The object
is built when Megatron-LM imports it, from Megatron's parsed arguments (normalization, QK layernorm, MoE),
exactly as Megatron-LM builds its local spec; ``sdpa_layer_spec(...)`` builds one for the Python API.

Megatron-core's local ``DotProductAttention`` materialises [b, heads, s, s] scores and their softmax (8 GiB
per layer in bf16 at 16k tokens with 16 heads); PyTorch's flash, cuDNN and memory-efficient backends keep
the output and a log-sum-exp per token and head. PyTorch picks the backend; the first layer logs its pick.
Checked against megatron-core 0.19.2.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_offload.config.long_context_flags import SDPA_SPEC

__all__ = ["SDPAttention", "gpt_layer_spec", "sdpa_layer_spec"]

SPEC_FLAG = "--spec " + " ".join(SDPA_SPEC)


def _backend_name(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> str:
    """The backend ``scaled_dot_product_attention`` will take for these inputs (PyTorch's own chooser)."""
    try:
        choice = torch._fused_sdp_choice(query, key, value, None, **kwargs)
        return torch.nn.attention.SDPBackend(choice).name
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a PyTorch without the chooser
        return "chosen by PyTorch (not reported by this version)"


class SDPAttention(DotProductAttention):
    """``DotProductAttention``'s interface ([s, b, heads, head_dim] in, [s, b, hidden] out) on
    ``torch.nn.functional.scaled_dot_product_attention``: causal, grouped-query heads, dropout under
    Megatron's RNG tracker as the local attention has it.

    NOTE: the flash backend's backward accumulates the query gradient with atomics; runs compared
    bitwise use Megatron's ``--deterministic-mode``, under which PyTorch takes its deterministic path."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, *args: Any, **kwargs: Any):
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        unsupported = [
            (config.softmax_type != "vanilla", f"--softmax-type {config.softmax_type}", "use vanilla"),
            (config.window_size is not None, f"--window-size {config.window_size}", "drop it"),
            (attn_mask_type != AttnMaskType.causal, f"attention mask {attn_mask_type.name}", "use a causal GPT"),
        ]
        for bad, what, advice in unsupported:
            if bad:
                raise ValueError(f"megatron-offload: the SDPA layer spec ({SPEC_FLAG}) cannot take {what}: {advice}")
        softmax_scale = kwargs.get("softmax_scale")
        # The local attention divides its scale by the layer number and multiplies it back inside its fp32
        # softmax (--apply-query-key-layer-scaling): the scale applied is this one either way.
        default_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.sdpa_scale = softmax_scale if softmax_scale is not None else default_scale
        self.backend: str | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                f"megatron-offload: the SDPA layer spec ({SPEC_FLAG}) takes neither packed sequences nor an "
                "attention bias: drop them or use TransformerEngine's spec"
            )
        if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal:
            raise ValueError(f"megatron-offload: the SDPA layer spec ({SPEC_FLAG}) supports causal attention only")
        sq, b, heads, head_dim = query.shape
        # [s, b, n, d] -> [b, n, s, d]: views; the last dimension stays contiguous, as the backends need.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        options = {"dropout_p": dropout, "is_causal": True, "scale": self.sdpa_scale, "enable_gqa": k.shape[1] != heads}
        if self.backend is None:
            self.backend = _backend_name(q, k, v, **options)
            if self.layer_number == 1 and _first_rank():
                print(
                    f"megatron-offload: attention through torch.nn.functional.scaled_dot_product_attention, "
                    f"backend {self.backend} ({q.dtype}, {heads} heads, {k.shape[1]} key/value groups, {sq} tokens)",
                    flush=True,
                )
        if dropout and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # as the local attention draws its dropout
                context = F.scaled_dot_product_attention(q, k, v, **options)
        else:
            context = F.scaled_dot_product_attention(q, k, v, **options)
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


def _first_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def sdpa_layer_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    normalization: str | None = None,
    qk_l2_norm: bool = False,
) -> ModuleSpec:
    """megatron-core's local GPT layer spec with ``SDPAttention`` as its core attention."""
    spec = get_gpt_layer_local_spec(
        num_experts, moe_grouped_gemm, qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm
    )
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def _spec_from_megatron_args() -> ModuleSpec:
    """As Megatron-LM's ``gpt_builders`` builds the local spec, from its parsed arguments where they exist."""
    try:
        from megatron.training import get_args

        args = get_args()
    except (ImportError, AssertionError):  # no megatron.training, or its arguments not parsed: the defaults
        return sdpa_layer_spec()
    qk_l2_norm = getattr(args, "qk_l2_norm", False)
    return sdpa_layer_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.normalization, qk_l2_norm)


# What ``--spec megatron_offload.megatron.sdpa_spec gpt_layer_spec`` imports (Megatron-LM reads the object).
gpt_layer_spec = _spec_from_megatron_args()
