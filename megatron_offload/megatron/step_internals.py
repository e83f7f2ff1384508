"""Every reach into megatron-core's optimizer step and DDP that the streamed step of weight streaming
needs (weights_step.py wires them). Checked against megatron-core 0.16.1 and 0.19.2 (the functions
named below are the same in both where it matters here).

What is relied on:
- ``optimizer/clip_grads.py``: without apex and TransformerEngine, ``l2_norm_impl`` is
  ``utils.local_multi_tensor_l2_norm``: ``torch.norm`` of each gradient (on the GPU), then
  ``torch.norm(torch.tensor(norms))`` (on the CPU, float32, shape ``[1, n]``), put on the GPU as one
  float32; ``get_grad_norm_fp32`` squares it, all-reduces it (SUM) over the grad-stats group and returns
  ``.item() ** 0.5`` (``multi_tensor_scale_tensor_impl`` is None, or absent in 0.16.1). ``norm_of_norms``
  repeats those steps on norms taken elsewhere. With apex's or TransformerEngine's
  ``multi_tensor_l2norm`` the total is summed per block of a kernel over all tensors at once, which no
  per-layer norms reproduce: the norm is then megatron-core's own, over the host gradients.
- ``clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad)`` is called by
  ``ChainedOptimizer.step`` and ``MegatronOptimizer.clip_grad_norm`` through the name in
  ``optimizer/optimizer.py``; it multiplies each ``param.grad`` by ``max_norm / (total_norm + 1e-6)`` when
  that is below 1, element by element (the same bits for any subset of the params, in any order).
- ``ChainedOptimizer.step`` (what ``get_megatron_optimizer`` returns) calls ``prepare_grads`` of each
  optimizer first, then ``get_grad_norm`` of its only optimizer (``get_grads_for_grad_norm`` gives each
  master's ``.grad``: at one data-parallel rank the whole of ``param.main_grad``, fp32, as a flat view).
- ``_ParamAndGradBucketGroup.check_grads(check_for_nan_or_inf, check_for_large)`` takes each bucket's
  ``grad_data.norm(p=2)`` and hands it to the rerun state machine's ``validate_result`` with ``torch.isnan``
  and ``torch.isinf``; ``bucket.params`` holds the bucket's params.
- ``_ParamAndGradBuffer.reset()`` is ``grad_data.zero_()`` plus zeroing ``extra_main_grads`` (0.19).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_offload.optimizer_state.staged_params import StagedParams
from megatron_offload.weights.grad_norms import SlotNorms

__all__ = ["ClipDeferral", "check_grads_from_slots", "local_norm_kernels", "norm_of_norms", "reset_without_zeroing"]

CLIP_NAME = "clip_grad_by_total_norm_fp32"


def local_norm_kernels() -> bool:
    """megatron-core takes the gradient norm with torch's kernels (no apex, no TransformerEngine)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    return (
        clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
        and getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is None
    )


def norm_of_norms(norms: Sequence[torch.Tensor], group: Any) -> float:
    """``get_grad_norm_fp32`` (norm type 2, torch's kernels) of gradients whose ``torch.norm``s are ``norms``:
    the same float. One host wait for all the norms, where megatron-core waits once per gradient."""
    per_tensor = torch.stack(list(norms)).cpu().view(1, -1)  # == torch.tensor([[n.item() for n in norms]])
    reduced = torch.norm(per_tensor)
    total = torch.tensor([float(reduced)], dtype=torch.float, device="cuda")
    total = total**2.0
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
    return total.item() ** (1.0 / 2.0)


class ClipDeferral:
    """Stands in ``megatron.core.optimizer.optimizer`` for ``clip_grad_by_total_norm_fp32``: a call over
    params that all belong to one registered stage is deferred to that stage's chunks (each chunk's
    gradients clipped by the same function, with the same arguments, before its update); any other
    call runs the original. One per process (it replaces a module's name); it owns that replacement."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.stage_of: dict[int, StagedParams] = {}  # id of each registered param -> its stage

    @classmethod
    def install(cls) -> ClipDeferral:
        from megatron.core.optimizer import optimizer as module

        current = getattr(module, CLIP_NAME)
        if isinstance(current, cls):
            return current
        deferral = cls(current)
        setattr(module, CLIP_NAME, deferral)
        return deferral

    def register(self, params: Sequence[torch.Tensor], stage: StagedParams) -> None:
        self.stage_of.update({id(param): stage for param in params})

    def unregister(self, params: Sequence[torch.Tensor]) -> None:
        for param in params:
            self.stage_of.pop(id(param), None)
        if not self.stage_of:
            from megatron.core.optimizer import optimizer as module

            if getattr(module, CLIP_NAME) is self:
                setattr(module, CLIP_NAME, self.original)

    def __call__(self, parameters: Any, max_norm: Any, total_norm: Any, use_decoupled_grad: bool = False) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        stages = {id(self.stage_of.get(id(param))) for param in params}
        stage = self.stage_of.get(id(params[0])) if params else None
        if stage is None or use_decoupled_grad or len(stages) != 1 or isinstance(total_norm, torch.Tensor):
            return self.original(parameters, max_norm, total_norm, use_decoupled_grad=use_decoupled_grad)
        meant = {id(param) for param in params}

        def clip(chunk: Sequence[torch.Tensor]) -> None:
            mine = [param for param in chunk if id(param) in meant]
            if mine:
                self.original(mine, max_norm, total_norm, use_decoupled_grad=False)

        stage.defer_clip(clip)
        return None


def check_grads_from_slots(bucket_group: Any, norms: SlotNorms) -> Callable[[bool, bool], None]:
    """``bucket_group.check_grads`` with each bucket's norm made from its params' norms taken in the slots
    (the norm of the norms): the same verdicts (a NaN gradient makes both NaN; an infinite one, or a sum
    of squares past float32's range, both infinite, up to rounding at about 1.8e19). Without every norm,
    or with the check for large gradients (which compares magnitudes), megatron-core's own check runs."""
    original = bucket_group.check_grads

    @functools.wraps(original)
    def check_grads(check_for_nan_or_inf: bool, check_for_large: bool) -> None:
        found = [norms.norms_of([param.main_grad for param in bucket.params]) for bucket in bucket_group.buckets]
        if check_for_large or any(bucket_norms is None for bucket_norms in found):
            return original(check_for_nan_or_inf, check_for_large)
        if not check_for_nan_or_inf:
            return None
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        rerun_state_machine = get_rerun_state_machine()
        for i, bucket_norms in enumerate(found):
            grad_norm = torch.linalg.vector_norm(torch.stack(bucket_norms)) if bucket_norms else torch.zeros(())
            for rejection, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                rerun_state_machine.validate_result(
                    result=grad_norm,
                    rejection_func=rejection,
                    message=f"found {what} in local grad norm for bucket #{i} "
                    "in backward pass before data-parallel communication collective",
                    tolerance=0.001,  # as megatron-core's own check
                    fatal=True,
                )
        return None

    return check_grads


def reset_without_zeroing(buffer: Any, skipped: Callable[[], None]) -> Callable[[], None]:
    """``buffer.reset`` that leaves ``grad_data`` as it is (the streaming overwrites it before anything reads
    it) and calls ``skipped()`` to say so; ``extra_main_grads``, not streamed, are zeroed as before."""
    original = buffer.reset

    @functools.wraps(original)
    def reset() -> None:
        for grad in getattr(buffer, "extra_main_grads", ()):
            grad.zero_()
        skipped()

    return reset
