"""Long-context training in Megatron-LM's loop: once Megatron has built the model (its optimizer getter is
called with the model chunks), the layer-input offloader and the chunked loss are attached to them, as the
flags ask. The attention is a layer spec Megatron-LM builds itself (``sdpa_spec``)."""

from __future__ import annotations

from typing import Any

from megatron_offload.activations.layer_inputs import LayerInputStats
from megatron_offload.config.long_context_flags import LongContextConfig
from megatron_offload.core.units import GIB
from megatron_offload.megatron.long_context_adapter import (
    LongContextHandle,
    attach_chunked_loss,
    attach_layer_input_offloader,
)

__all__ = ["attach_long_context", "layer_input_log_fields"]


def attach_long_context(model_chunks: Any, config: LongContextConfig) -> LongContextHandle | None:
    """Attach what ``config`` asks for; None when it asks for nothing. Returns the handle, whose ``detach``
    undoes it; a failure undoes what was attached and raises."""
    if not config.wanted:
        return None
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    handle = LongContextHandle()
    try:
        if config.layer_inputs:
            attach_layer_input_offloader(chunks, handle)
        if config.chunked_loss:
            attach_chunked_loss(chunks, handle, config.chunk_tokens)
    except BaseException:
        handle.detach()
        raise
    return handle


def describe(handle: LongContextHandle) -> str:
    parts = []
    if handle.layer_inputs is not None:
        parts.append("each checkpointed layer's input goes to pinned host memory after its forward")
    if handle.chunk_tokens is not None:
        parts.append(f"the loss is computed {handle.chunk_tokens} tokens at a time")
    return "megatron-offload: long context: " + "; ".join(parts)


def layer_input_log_fields(
    handle: LongContextHandle, before: LayerInputStats | None, steps: int = 1
) -> tuple[str, LayerInputStats | None]:
    """Megatron log-line fields since ``before`` (a previous ``read_stats``), and the new reading."""
    if handle.layer_inputs is None:
        return "", before
    now, before = handle.layer_inputs.read_stats(), before or LayerInputStats()
    per = max(steps, 1)
    out = (now.bytes_out - before.bytes_out) / per / GIB
    back = (now.bytes_in - before.bytes_in) / per / GIB
    exposed = (now.exposed_ms - before.exposed_ms) / per
    fields = (
        f" layer inputs out/in per iter (GiB): {out:.2f}/{back:.2f} | layer inputs exposed (ms): {exposed:.1f} |"
        f" layer inputs host (GiB): {now.host_bytes / GIB:.2f} |"
    )
    return fields, now
