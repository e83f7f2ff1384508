"""Activation memory: what the forward keeps for the backward, and where it lives."""

from megatron_offload.activations.chunked_loss import chunked_linear_cross_entropy, default_chunk_tokens
from megatron_offload.activations.layer_inputs import LayerInputOffloader, LayerInputStats

__all__ = ["LayerInputOffloader", "LayerInputStats", "chunked_linear_cross_entropy", "default_chunk_tokens"]
