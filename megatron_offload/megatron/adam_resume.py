"""megatron-core's resume with torch Adam (neither TransformerEngine nor apex installed), fixed for every
run, with or without offloading. It touches megatron-core internals, like megatron_adapter.py, but
serves every run rather than the offloader. Checked against megatron-core 0.16.1 and 0.19.2.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch

from megatron_offload.megatron.optimizer_internals import distributed_optimizers

__all__ = ["fix_torch_adam_checkpoints"]

_FIXED_ATTR = "_megatron_offload_adam_step_fix"


def fix_torch_adam_checkpoints(optimizer: Any) -> str | None:
    """Work around two megatron-core bugs of its torch-Adam path (neither TransformerEngine nor apex
    installed), seen in 0.16.1 and 0.19.2, with or without offloading; returns a line to log.

    - ``DistributedOptimizer.state_dict`` asserts that every param's Adam ``step`` is the same, and a
      fresh optimizer has none: building the load-side state dict of a resume fails before loading.
      A fresh optimizer now reports step 0 (which the load replaces), as a new torch Adam would.
    - ``DistributedOptimizer.load_state_dict`` gives every param one shared ``step`` tensor, which
      torch Adam then advances once per param per step, and the dp_reshardable load copies the
      pre-load count over the checkpoint's. After a load, each param gets a tensor of its own holding
      the checkpoint's count, as in a run that never stopped.
    Wraps the instances (no source is patched); with TransformerEngine or apex nothing is done.
    """
    from megatron.core.optimizer import distrib_optimizer

    have_fused_adam = getattr(distrib_optimizer, "HAVE_APEX_OR_TE", None)
    if have_fused_adam is None:  # a megatron-core laid out differently: say so now, not at the first load
        return (
            f"megatron-offload: megatron-core {version('megatron-core')} is not laid out as 0.16-0.19 "
            "(no distrib_optimizer.HAVE_APEX_OR_TE): the torch-Adam resume workaround is not applied"
        )
    if have_fused_adam:
        return None  # FusedAdam keeps its step in the param groups: neither bug applies
    for dist_opt in distributed_optimizers(optimizer):
        if vars(dist_opt).get(_FIXED_ATTR):
            continue
        inner = dist_opt.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        dist_opt.state_dict = _reports_step_when_fresh(dist_opt.state_dict, inner)
        dist_opt.load_state_dict = _own_steps_after_load(dist_opt.load_state_dict, inner)
        setattr(dist_opt, _FIXED_ATTR, True)
    return (
        f"megatron-offload: torch Adam without TransformerEngine or apex (megatron-core {version('megatron-core')}): "
        "checkpoint resume fixed for a fresh optimizer's state_dict and for per-param Adam steps"
    )


def _reports_step_when_fresh(state_dict: Callable[..., Any], inner: torch.optim.Optimizer) -> Callable[..., Any]:
    def state_dict_with_step(*args: Any, **kwargs: Any) -> Any:
        params = [param for group in inner.param_groups for param in group["params"]]
        if any("step" in inner.state.get(param, {}) for param in params):
            return state_dict(*args, **kwargs)  # trained: megatron-core's own code is right
        for param in params:
            inner.state[param]["step"] = torch.zeros((), dtype=torch.float32)
        try:
            return state_dict(*args, **kwargs)
        finally:  # the fresh optimizer stays fresh
            for param in params:
                del inner.state[param]["step"]
                if not inner.state[param]:
                    del inner.state[param]

    return state_dict_with_step


def _own_steps_after_load(load_state_dict: Callable[..., Any], inner: torch.optim.Optimizer) -> Callable[..., Any]:
    def load_then_own_steps(state_dict: dict, *args: Any, **kwargs: Any) -> Any:
        result = load_state_dict(state_dict, *args, **kwargs)
        groups = state_dict.get("optimizer", {}).get("param_groups", [])
        steps = {group["step"] for group in groups if "step" in group}
        if len(steps) == 1:
            (step,) = steps
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    old = state["step"]
                    state["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device)
        return result

    return load_then_own_steps
