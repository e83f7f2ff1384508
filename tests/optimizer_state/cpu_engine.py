"""Helpers shared by the engine's CPU tests (test_engine_cpu.py, test_chunks.py, test_plan.py,
test_engine_errors.py and others in this folder): Adam over fp32 masters, seeded steps and gradients, an
offloader that neither pins nor checks host room, the streamed step with its copies landed, and where a
tensor's data now lives.
"""

from __future__ import annotations

import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.optimizer_state import streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper
from megatron_offload.optimizer_state.plan import ALIGN


def adam_with_masters(sizes: tuple[int, ...] = (37, 1000, 5)) -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    """fp32 masters that are the optimizer's params, like DistributedOptimizer's inner Adam."""
    masters = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    return torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1), masters


def take_step(optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
    optimizer.step()


def offloader_for(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], **kwargs) -> OptimizerStateOffloader:
    return OptimizerStateOffloader(optimizer, masters, pin_memory=False, check_host_memory=False, **kwargs)


def run_step(offloader: OptimizerStateOffloader, after_chunk=None) -> None:
    """The streamed step, with one stepper per offloader (its lists are made once per plan), then the
    copies it queued have landed, as they have once the training loop's next points have passed."""
    stepper = offloader.__dict__.setdefault("_test_stepper", ChunkStepper(offloader.optimizer))
    try:
        streamed_step.run(offloader, stepper, after_chunk)
    finally:
        offloader.copies.drain()


def in_host_slab(offloader: OptimizerStateOffloader, tensor: torch.Tensor) -> bool:
    """True when ``tensor`` now holds its host copy (on CPU the device and host are both memory, so
    where the data lives is the only difference there is)."""
    return tensor.untyped_storage().data_ptr() == offloader.state.host_slab.tensor.untyped_storage().data_ptr()


def entries(offloader: OptimizerStateOffloader) -> list:
    return [entry for chunk in offloader.chunks for entry in chunk.entries]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def many_masters() -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    torch.manual_seed(0)
    return adam_with_masters((37, 1000, 5, 300, 64, 700, 1))


def set_grads(optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)


def assert_same_training_state(reference: torch.optim.Optimizer, actual: torch.optim.Optimizer) -> None:
    for a, b in zip(reference.param_groups[0]["params"], actual.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(reference.state[a][key], actual.state[b][key]), key
