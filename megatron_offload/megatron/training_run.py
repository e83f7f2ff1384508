"""What the hooks on Megatron-LM's training loop hold for one process, in one object: ``install_training_hooks``
makes it once and hands it to every wrapper that attaches something or reads it back.

It is kept on the ``megatron.training.training`` module whose names the hooks replace, which makes it also
the guard against installing twice: the hooks and their state are installed together or not at all, and a
fresh ``megatron.training`` (as tests stand one in) starts with neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_offload.config.long_context_flags import LongContextConfig
from megatron_offload.megatron.long_context_adapter import LongContextHandle
from megatron_offload.megatron.optimizer_adapter import OffloadHandle
from megatron_offload.megatron.weights_training import StreamedWeights

__all__ = ["RUN_ATTR", "TrainingRun", "current_run"]

RUN_ATTR = "_megatron_offload_run"
"""The attribute of ``megatron.training.training`` that holds the run once the hooks are installed."""


@dataclass
class TrainingRun:
    """The offloaders, long-context handles and streamed weights attached by the hooks in this process,
    and the figures the log line last read from each."""

    offloads: list[OffloadHandle] = field(default_factory=list)
    """One per optimizer Megatron built, with ``--offload-optimizer-states``."""
    long_context_config: LongContextConfig = field(default_factory=LongContextConfig)
    """What ``--offload-layer-inputs`` and ``--chunked-loss`` ask for, read once after validation."""
    long_context: list[LongContextHandle] = field(default_factory=list)
    """One per model Megatron built, with ``--offload-layer-inputs`` or ``--chunked-loss``."""
    weights: StreamedWeights = field(default_factory=StreamedWeights)
    """With ``--offload-weights``: the host memory the model is built into and its streamers."""
    logged: dict[int, Any] = field(default_factory=dict)
    """Each handle's figures (by ``id``) when the log line last read them."""
    gpu_memory_cap_bytes: int | None = None
    """The cap argument validation applied to this process (``--offload-gpu-memory-cap-gib``), which the
    weights' build lifts and sets again; None: none was."""


def current_run() -> TrainingRun | None:
    """The run the hooks installed in this process hold; None before, or without megatron.training."""
    try:
        from megatron.training import training
    except ImportError:
        return None
    return getattr(training, RUN_ATTR, None)
