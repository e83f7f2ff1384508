"""Optimizer-state offloading, weight streaming and long-context training for megatron-core.

Adam's moments and the fp32 master weights live in pinned host memory between optimizer steps and
come back on a side CUDA stream before the next step; the Adam math stays on the GPU. With weight
streaming, every transformer layer's weights and gradients live in host memory too and stream through
a few GPU slots, layer by layer.
"""

from megatron_offload.config.flag_checks import validate_offload_args
from megatron_offload.config.flags import add_offload_args, config_from_args
from megatron_offload.config.options import OffloadConfig, PrefetchPolicy
from megatron_offload.core.host_memory import HostMemoryError
from megatron_offload.core.stats import OffloadStats
from megatron_offload.megatron.optimizer_adapter import (
    CHECKED_MEGATRON_CORE_VERSIONS,
    OffloadFitError,
    OffloadHandle,
    attach_offloader,
)
from megatron_offload.megatron.sleep_hooks import MegatronSleeper, install_rl_sleep_hooks, sleep_wake_for
from megatron_offload.optimizer_state.offloader import OffloadCopyError, OptimizerStateOffloader
from megatron_offload.sleep.report import SleepError, SleepReport

__version__ = "0.1.0"

__all__ = [
    "CHECKED_MEGATRON_CORE_VERSIONS",
    "HostMemoryError",
    "MegatronSleeper",
    "OffloadCopyError",
    "OffloadFitError",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadStats",
    "OptimizerStateOffloader",
    "PrefetchPolicy",
    "SleepError",
    "SleepReport",
    "add_offload_args",
    "attach_offloader",
    "config_from_args",
    "install_rl_sleep_hooks",
    "sleep_wake_for",
    "validate_offload_args",
]
