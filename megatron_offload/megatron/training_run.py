"""What the hooks on Megatron-LM's training loop hold for one process, in one object: ``install_training_hooks``
makes it once and hands it to every wrapper that attaches something or reads it back.

It is kept on the ``megatron.training.training`` module whose names the hooks replace, which makes it also
the guard against installing twice: the hooks and their state are installed together or not at all, and a
fresh ``megatron.training`` (as tests stand one in) starts with neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from megatron_offload.config.long_context_flags import LongContextConfig
from megatron_offload.megatron.long_context_adapter import LongContextHandle
from megatron_offload.megatron.optimizer_adapter import OffloadHandle
from megatron_offload.megatron.weights_training import StreamedWeights

__all__ = ["RUN_ATTR", "TrainingRun", "current_run"]

_ITERATION = re.compile(r" iteration\s+(\d+)\s*/")

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
    logged_iteration: int | None = None
    """The iteration Megatron's last log line named; None before the first line."""

    def iterations_since_last_line(self, message: str, start: int) -> int:
        """How many iterations Megatron's log line ``message`` covers: since the iteration of the line before,
        or since ``start`` (the iteration training started from: 0, or the checkpoint's) for the first line.
        At least 1; 1 where the line names no iteration."""
        found = _ITERATION.search(message)
        if found is None:
            return 1
        iteration = int(found.group(1))
        before = start if self.logged_iteration is None else self.logged_iteration
        self.logged_iteration = iteration
        return max(iteration - before, 1)


def current_run() -> TrainingRun | None:
    """The run the hooks installed in this process hold; None before, or without megatron.training."""
    try:
        from megatron.training import training
    except ImportError:
        return None
    return getattr(training, RUN_ATTR, None)
