"""The torch-Adam checkpoint fix, against megatron-core's own DistributedOptimizer methods on the CPU.

A DistributedOptimizer needs CUDA to be built, but its ``state_dict`` only reads the inner optimizer and
the grad scaler: the real method runs here on an instance given just those. The GPU tests and the
integration entries ``checkpoint`` and ``checkpoint-no-offload`` resume through Megatron-LM for real.
"""

from __future__ import annotations

import pytest
import torch

distrib_optimizer = pytest.importorskip("megatron.core.optimizer.distrib_optimizer", reason="needs megatron-core")
if distrib_optimizer.HAVE_APEX_OR_TE:
    pytest.skip(
        "TransformerEngine or apex is installed: the torch-Adam path is not megatron-core's", allow_module_level=True
    )

from megatron_offload.megatron.adam_resume import fix_torch_adam_checkpoints  # noqa: E402


def distributed_optimizer(params: list[torch.Tensor]) -> object:
    """A real DistributedOptimizer object with only what ``state_dict`` and our wrappers read."""
    dist_opt = distrib_optimizer.DistributedOptimizer.__new__(distrib_optimizer.DistributedOptimizer)
    dist_opt.optimizer = torch.optim.AdamW(params, lr=0.1)
    dist_opt.grad_scaler = None
    return dist_opt


def adam_step(dist_opt: object, steps: int) -> None:
    for _ in range(steps):
        for group in dist_opt.optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.ones_like(param)
        dist_opt.optimizer.step()


def test_megatron_core_cannot_describe_a_fresh_torch_adam_without_the_fix() -> None:
    dist_opt = distributed_optimizer([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(AssertionError):
        dist_opt.state_dict()  # the bug a resume hits before anything is loaded


def test_a_fresh_optimizer_reports_step_zero_and_stays_fresh() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    dist_opt = distributed_optimizer(params)
    assert fix_torch_adam_checkpoints(dist_opt).startswith("megatron-offload: torch Adam")
    state = dist_opt.state_dict()
    assert [group["step"] for group in state["optimizer"]["param_groups"]] == [0.0]
    assert len(dist_opt.optimizer.state) == 0  # nothing left behind: the first step starts from scratch
    adam_step(dist_opt, 3)
    assert [group["step"] for group in dist_opt.state_dict()["optimizer"]["param_groups"]] == [3.0]


def test_after_a_load_every_param_counts_its_own_steps_from_the_checkpoint() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    dist_opt = distributed_optimizer(params)
    adam_step(dist_opt, 1)
    shared = torch.tensor(1.0)

    def megatron_like_load(state_dict: dict) -> None:  # what 0.16/0.19 leave: one tensor, the old count
        for state in dist_opt.optimizer.state.values():
            state["step"] = shared

    dist_opt.load_state_dict = megatron_like_load
    fix_torch_adam_checkpoints(dist_opt)
    dist_opt.load_state_dict({"optimizer": {"param_groups": [{"step": 7.0}]}})
    steps = [state["step"] for state in dist_opt.optimizer.state.values()]
    assert [float(step) for step in steps] == [7.0, 7.0] and steps[0] is not steps[1]
    adam_step(dist_opt, 1)
    assert [float(state["step"]) for state in dist_opt.optimizer.state.values()] == [8.0, 8.0]


def test_the_fix_is_applied_once() -> None:
    dist_opt = distributed_optimizer([torch.nn.Parameter(torch.ones(3))])
    fix_torch_adam_checkpoints(dist_opt)
    wrapped = dist_opt.state_dict
    fix_torch_adam_checkpoints(dist_opt)
    assert dist_opt.state_dict is wrapped


def test_the_python_api_answers_in_its_own_names() -> None:
    from megatron_offload import attach_offloader, sleep_wake_for

    with pytest.raises(TypeError, match=r"^'chunkmb' is not an offload setting \(did you mean 'chunk_mb'\?\)"):
        attach_offloader(object(), chunkmb=32)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    for call in (attach_offloader, sleep_wake_for):
        with pytest.raises(TypeError) as error:
            call(adam)
        assert str(error.value).startswith("expected megatron-core's DistributedOptimizer (or a ChainedOptimizer")
        assert "got Adam" in str(error.value) and "--offload" not in str(error.value)
