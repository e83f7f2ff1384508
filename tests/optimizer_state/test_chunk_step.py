"""The chunked update: torch's own functional Adam per chunk, bitwise equal to one ``step()``; other
optimizers step themselves over the chunk, and count one step however many chunks there are."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.optimizer_state.chunk_step import ChunkStepper, RestrictedStep


def params_and_grads(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in (7, 300, 64, 1000, 3)]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("options", [{"foreach": True}, {"foreach": False}, {"amsgrad": True, "maximize": True}])
def test_chunks_updated_by_the_functional_match_one_step_bit_for_bit(cls, options: dict) -> None:
    reference, chunked = params_and_grads(0), params_and_grads(0)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    ref_opt = cls(groups(reference), lr=1e-2, weight_decay=0.1, **options)
    opt = cls(groups(chunked), lr=1e-2, weight_decay=0.1, **options)
    stepper = ChunkStepper(opt)
    assert stepper.functional is not None  # torch's own functional, not a whole step per chunk
    made = []
    for step in range(4):
        set_grads(reference, step)
        set_grads(chunked, step)
        chunked[4].grad = reference[4].grad = None if step == 2 else reference[4].grad  # skipped like step()
        ref_opt.step()
        stepper.begin()
        for key, chunk in enumerate(([chunked[1], chunked[2]], [chunked[0]], chunked[3:])):  # across groups
            made.append(stepper(chunk, key=key))
    # Without state the optimizer's own step ran (it made the moments); with state, the functional alone, also
    # for a chunk whose param has no gradient this step.
    assert made == [True] * 3 + [False] * 9
    for mine, theirs in zip(chunked, reference, strict=True):
        assert torch.equal(mine, theirs)
        for name, value in ref_opt.state[theirs].items():
            assert torch.equal(opt.state[mine][name], value), name


def test_other_optimizers_step_themselves_over_the_chunk() -> None:
    params = params_and_grads(1)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    stepper = ChunkStepper(sgd)
    assert stepper.functional is None
    set_grads(params, 0)
    before = [p.detach().clone() for p in params]
    stepper(params[:2])
    assert not torch.equal(params[0], before[0]) and torch.equal(params[3], before[3])  # only the chunk moved


class GroupCountingAdam(torch.optim.Optimizer):
    """Counts steps per param group, as apex's and TransformerEngine's FusedAdam do."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for param in group["params"]:
                param.add_(param.grad, alpha=-group["lr"] / group["step"])


def test_restricted_step_counts_one_step_however_many_chunks() -> None:
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    optimizer = GroupCountingAdam(params)
    for param in params:
        param.grad = torch.ones(4)
    stepper = RestrictedStep(optimizer)
    for param in params:
        stepper([param])
    assert optimizer.param_groups[0]["step"] == 1
    assert len(optimizer.param_groups[0]["params"]) == 3
    assert all(torch.equal(p, torch.full((4,), 0.9)) for p in params)
