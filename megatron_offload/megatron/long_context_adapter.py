"""Every touch of megatron-core for long-context training. Checked against megatron-core 0.19.2.

What it relies on:
- Under ``--recompute-granularity full`` a ``TransformerBlock`` in training runs its layers through
  ``tensor_parallel.checkpoint`` (``CheckpointFunction``), whose forward runs without grad and saves the
  chunk's inputs with ``ctx.save_for_backward``; the first is the hidden states the chunk's first
  ``TransformerLayer`` is called with (keyword ``hidden_states``), the very tensor object. Its backward
  reads them back once (``ctx.saved_tensors``) and reruns the layers.
- ``GPTModel.forward`` takes ``output_processor`` (0.19 and later): called with the final hidden states,
  the output layer, the shared weight, the labels, it returns what the model returns (the per-token loss
  [b, s] when labels are given).
Everything is wrapped or hooked on instances; no source is changed, and ``detach`` undoes it all.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_offload.activations.chunked_loss import chunked_linear_cross_entropy, default_chunk_tokens
from megatron_offload.activations.layer_inputs import LayerInputOffloader
from megatron_offload.core.patches import InstancePatches
from megatron_offload.core.streams import streams_for

__all__ = [
    "CHUNKED_LOSS_NEEDS",
    "LongContextHandle",
    "attach_chunked_loss",
    "attach_layer_input_offloader",
    "supports_output_processor",
]

CHUNKED_LOSS_NEEDS = "--chunked-loss needs megatron-core 0.19 or later (GPTModel's output_processor): upgrade it"


@dataclass
class LongContextHandle:
    """What the attach functions did, so that it can be read and undone."""

    layer_inputs: LayerInputOffloader | None = None
    chunk_tokens: int | None = None
    patches: InstancePatches = field(default_factory=InstancePatches)

    def detach(self) -> None:
        self.patches.undo()


def _types() -> tuple[type, type, type]:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return GPTModel, TransformerBlock, TransformerLayer


def attach_layer_input_offloader(model_chunks: list[Any], handle: LongContextHandle, pin: bool = True) -> None:
    """Send each checkpointed layer's input to pinned host memory after its forward and bring it back
    ahead of its recompute (``activations/layer_inputs.py``), in every block of ``model_chunks``."""
    _, block_type, layer_type = _types()
    blocks = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, block_type)]
    if not blocks:
        raise ValueError("--offload-layer-inputs found no TransformerBlock in this model")
    device = next(p.device for chunk in model_chunks for p in chunk.parameters())
    offloader = LayerInputOffloader(streams_for(device), pin=pin)
    handle.layer_inputs = offloader

    def run_block(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation or inference: nothing is saved for a backward
            return original(*args, **kwargs)
        offloader.begin_pass()
        with offloader.hooks():
            output = original(*args, **kwargs)
        offloader.end_pass()
        return output

    def note(module: Any, args: tuple, kwargs: dict) -> None:
        # Without grad in training: inside a checkpoint's forward, whose saved input this is.
        if module.training and not torch.is_grad_enabled():
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(hidden, torch.Tensor):
                offloader.note_input(hidden)

    for block in blocks:
        handle.patches.wrap(block, "forward", run_block)
        for layer in block.modules():
            if isinstance(layer, layer_type):
                handle.patches.hook(layer.register_forward_pre_hook(note, with_kwargs=True))


def supports_output_processor() -> bool:
    """Whether this megatron-core's ``GPTModel.forward`` takes ``output_processor`` (0.19 and later)."""
    gpt_type, _, _ = _types()
    return "output_processor" in inspect.signature(gpt_type.forward).parameters


def attach_chunked_loss(model_chunks: list[Any], handle: LongContextHandle, chunk_tokens: int | None = None) -> None:
    """Compute the loss of every GPT in ``model_chunks`` that ends in the output layer with
    ``chunked_linear_cross_entropy``: no [tokens, vocab] logits exist. Without labels (inference), the
    model returns its logits as before."""
    gpt_type, _, _ = _types()
    if not supports_output_processor():
        raise ValueError(CHUNKED_LOSS_NEEDS)
    models = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, gpt_type) and m.post_process]
    if not models:
        return  # a pipeline stage without the output layer: nothing to do
    vocab = models[0].vocab_size
    handle.chunk_tokens = chunk_tokens or default_chunk_tokens(vocab)

    def loss(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: Any, labels: Any, **_: Any) -> Any:
        weight = output_weight if output_weight is not None else output_layer.weight
        return chunked_linear_cross_entropy(hidden_states, weight, labels, handle.chunk_tokens)

    def run_model(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        if labels is not None and kwargs.get("output_processor") is None:
            kwargs["output_processor"] = loss
        return original(*args, **kwargs)

    for model in models:
        handle.patches.wrap(model, "forward", run_model)
