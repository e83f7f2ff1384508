"""The optimizer's update of a subset of its params, bitwise equal to one ``step()`` over all of them.

For torch's Adam and AdamW a chunk is one call of torch's functional ``adam`` per param group, lists
made once per plan: the kernels ``step()`` runs, none of its per-call walks. Anything else, and a
param without state yet, goes through ``RestrictedStep`` (``step()`` with groups cut to the chunk).
Bitwise equal for optimizers that update each param from its own state (not LAMB's global norm).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Hashable, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["ChunkStepper", "RestrictedStep"]


class RestrictedStep:
    """Runs ``optimizer.step()`` over a subset of its params, as if it ran once.

    Every call sees the param-group settings as they were when the step began (``begin()``): apex's
    and TransformerEngine's FusedAdam count steps per group (``group["step"] += 1``), so without this a
    step cut into five chunks would count five steps.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[[], object] | None = None) -> None:
        self.optimizer = optimizer
        # The class's step: an instance attribute ``step`` may be a wrapper that calls us.
        self.step = step or functools.partial(type(optimizer).step, optimizer)
        self.begin()

    def begin(self) -> None:
        """Take the group settings as they are now: the start of one optimizer step."""
        self.settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def __call__(self, params: Sequence[torch.Tensor]) -> None:
        wanted = {id(param) for param in params}
        groups = self.optimizer.param_groups
        every_param = [group["params"] for group in groups]
        try:
            for group, settings, group_params in zip(groups, self.settings, every_param, strict=True):
                for key in [key for key in group if key != "params" and key not in settings]:
                    del group[key]  # added by an earlier chunk's call, e.g. a first "step"
                group.update(settings)
                group["params"] = [param for param in group_params if id(param) in wanted]
            self.step()
        finally:
            for group, group_params in zip(groups, every_param, strict=True):
                group["params"] = group_params


def _functional_of(optimizer: torch.optim.Optimizer) -> Callable[..., None] | None:
    """The functional torch's own ``step()`` of this optimizer calls (``adam``, or ``adamw`` where AdamW
    has a step of its own), or None when the optimizer is anything else or its step was replaced."""
    own = type(optimizer).step
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return None
    for class_name, module_name in (("AdamW", "torch.optim.adamw"), ("Adam", "torch.optim.adam")):
        cls = getattr(torch.optim, class_name, None)
        if cls is None or not isinstance(optimizer, cls) or own is not cls.step or "step" not in vars(cls):
            continue
        try:
            return getattr(importlib.import_module(module_name), class_name.lower(), None)
        except ImportError:
            return None
    return None


class ChunkStepper:
    """Updates chunks of params; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.restricted = RestrictedStep(optimizer)
        self.functional = _functional_of(optimizer)
        self._accepts = set(inspect.signature(self.functional).parameters) if self.functional else set()
        logger.info(
            "megatron-offload: each chunk is updated by %s",
            f"torch's functional {self.functional.__name__} (one call per chunk)"
            if self.functional
            else f"{type(optimizer).__name__}.step() over the chunk's params",
        )
        self._group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self._lists: dict[Hashable, list[tuple[int, list[torch.Tensor]]]] = {}
        self.plan: object = None  # the plan the lists were made for (held, so its id is never reused)

    def begin(self) -> None:
        """At the start of each optimizer step."""
        self.restricted.begin()

    def forget(self, plan: object = None) -> None:
        """A new plan (its chunks are other sets of params): make the lists again."""
        self.plan = plan
        self._lists.clear()
        self._group_of = {id(p): i for i, group in enumerate(self.optimizer.param_groups) for p in group["params"]}

    @torch.no_grad()
    def __call__(self, params: Sequence[torch.Tensor], key: Hashable | None = None) -> bool:
        """Update ``params`` (``key`` names the set, so its lists are made once). True where the optimizer's own
        ``step()`` ran, which may have made new state; the functional only updates the state each param has."""
        state = self.optimizer.state
        if self.functional is None or not all(state.get(p) for p in params):
            self.restricted(params)
            return True
        by_group = self._lists.get(key) if key is not None else None
        if by_group is None:
            grouped: dict[int, list[torch.Tensor]] = {}
            for param in params:
                grouped.setdefault(self._group_of[id(param)], []).append(param)
            by_group = sorted(grouped.items())
            if key is not None:
                self._lists[key] = by_group
        for index, group_params in by_group:
            self._adam(self.optimizer.param_groups[index], [p for p in group_params if p.grad is not None])
        return False

    def _adam(self, group: dict, params: list[torch.Tensor]) -> None:
        """The functional with the arguments the optimizer's ``step()`` passes for this group."""
        if not params:
            return
        state = self.optimizer.state
        beta1, beta2 = group["betas"]
        settings = {
            "amsgrad": group["amsgrad"],
            "has_complex": any(torch.is_complex(p) for p in params),
            "beta1": beta1,
            "beta2": beta2,
            "lr": group["lr"],
            "weight_decay": group["weight_decay"],
            "eps": group["eps"],
            "maximize": group["maximize"],
            "foreach": group["foreach"],
            "capturable": group["capturable"],
            "differentiable": group.get("differentiable", False),
            "fused": group["fused"],
            "grad_scale": None,
            "found_inf": None,
            "decoupled_weight_decay": group.get("decoupled_weight_decay", False),
        }
        self.functional(
            params,
            [p.grad for p in params],
            [state[p]["exp_avg"] for p in params],
            [state[p]["exp_avg_sq"] for p in params],
            [state[p]["max_exp_avg_sq"] for p in params] if group["amsgrad"] else [],
            [state[p]["step"] for p in params],
            **{key: value for key, value in settings.items() if key in self._accepts},
        )
