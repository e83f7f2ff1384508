"""Sleep and wake through the megatron-core adapter, on real megatron-core classes built on the CPU.

DistributedDataParallel, _ParamAndGradBuffer and DistributedOptimizer need CUDA and process groups to
be constructed, so real instances are made with ``__new__`` and given just the attributes megatron-core
itself would set and the adapter reads (params as views into the buffer, as ``_ParamAndGradBuffer``
maps them); ChainedOptimizer is built by its own ``__init__``. The GPU test trains a real GPT.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core")
from megatron.core.distributed import DistributedDataParallel  # noqa: E402
from megatron.core.distributed.param_and_grad_buffer import (  # noqa: E402
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402
from megatron.core.optimizer.optimizer import ChainedOptimizer  # noqa: E402

from megatron_offload import SleepError, attach_offloader, sleep_wake_for  # noqa: E402
from megatron_offload.megatron.sleep_hooks import route_rl_offload_through_sleep  # noqa: E402


def ddp_chunk(seed: int, with_param_buffer: bool = True) -> DistributedDataParallel:
    """A DDP chunk around a Linear whose bf16 params and fp32 main grads are views into flat buffers."""
    generator = torch.Generator().manual_seed(seed)
    inner = torch.nn.Linear(8, 4).bfloat16()
    buffer = _ParamAndGradBuffer.__new__(_ParamAndGradBuffer)
    numel = sum(p.numel() for p in inner.parameters())
    buffer.grad_data = torch.randn(numel, generator=generator)
    buffer.param_data = torch.randn(numel, generator=generator).bfloat16() if with_param_buffer else None
    offset = 0
    for param in inner.parameters():
        if with_param_buffer:
            param.data = buffer.param_data[offset : offset + param.numel()].view(param.shape)
        param.main_grad = buffer.grad_data[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
    chunk = DistributedDataParallel.__new__(DistributedDataParallel)
    torch.nn.Module.__init__(chunk)
    chunk.module = inner
    chunk.buffers, chunk.expert_parallel_buffers = [buffer], []
    group = _ParamAndGradBucketGroup.__new__(_ParamAndGradBucketGroup)
    group.grad_reduce_handle = group.param_gather_handle = None
    chunk.bucket_groups, chunk.expert_parallel_bucket_groups = [group], []
    return chunk


def dist_opt(chunk: DistributedDataParallel) -> DistributedOptimizer:
    """A DistributedOptimizer with fp32 masters of the chunk's params and a torch AdamW over them."""
    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in chunk.module.parameters()]
    opt.shard_fp32_from_float16_groups = [masters]
    opt.optimizer = torch.optim.AdamW(masters, lr=1e-2)
    opt.model_chunks, opt.config = [chunk], None
    return opt


def adam_step(optimizer: ChainedOptimizer, seed: int) -> None:
    """The inner Adam steps (what DistributedOptimizer.step runs once the grads are in the masters)."""
    generator = torch.Generator().manual_seed(seed)
    for inner in optimizer.chained_optimizers:
        for master in inner.shard_fp32_from_float16_groups[0]:
            master.grad = torch.randn(master.shape, generator=generator)
        inner.optimizer.step()


def build(seed: int = 0) -> tuple[ChainedOptimizer, list[DistributedDataParallel]]:
    chunks = [ddp_chunk(seed), ddp_chunk(seed + 10)]
    return ChainedOptimizer([dist_opt(chunk) for chunk in chunks]), chunks


def snapshot(optimizer: ChainedOptimizer, chunks: list[DistributedDataParallel]) -> list[torch.Tensor]:
    out = []
    for inner in optimizer.chained_optimizers:
        for master in inner.shard_fp32_from_float16_groups[0]:
            out += [master.detach().clone(), *(v.clone() for v in inner.optimizer.state[master].values())]
    for chunk in chunks:
        out += [chunk.buffers[0].grad_data.clone(), chunk.buffers[0].param_data.clone()]
        out += [p.detach().clone() for p in chunk.module.parameters()] + [
            p.main_grad.clone() for p in chunk.module.parameters()
        ]
    return out


def test_a_chained_optimizer_sleeps_every_part_and_wakes_bitwise() -> None:
    optimizer, chunks = build()
    adam_step(optimizer, 0)
    before = snapshot(optimizer, chunks)
    sleeper = sleep_wake_for(optimizer)  # model chunks found through the DistributedOptimizers
    assert sleep_wake_for(optimizer) is sleeper and len(sleeper.sleeper.offloaders) == 2

    report = sleeper.sleep(optimizer=True, grads=True, params=True)
    for chunk in chunks:
        assert chunk.buffers[0].grad_data.untyped_storage().nbytes() == 0
        assert chunk.buffers[0].param_data.untyped_storage().nbytes() == 0
    assert all(o.is_offloaded for o in sleeper.sleeper.offloaders)
    assert {t.part for t in report.transfers} == {"optimizer", "grads", "params"}
    with pytest.raises(SleepError, match=r"parameters are asleep: call wake\(\)"):
        chunks[0](torch.ones(2, 8, dtype=torch.bfloat16))
    with pytest.raises(SleepError, match=r"optimizer.step\(\) while optimizer, grads, params sleep: call wake\(\)"):
        optimizer.step()

    with pytest.raises(SleepError, match=r"gradient buffers are asleep: call wake\(\) before the next training step"):
        chunks[1].zero_grad_buffer()  # what a training step does first; would write freed memory

    sleeper.wake()
    for a, b in zip(snapshot(optimizer, chunks), before, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert "zero_grad_buffer" not in vars(chunks[1])  # DDP's own method again
    assert chunks[0](torch.ones(2, 8, dtype=torch.bfloat16)).shape == (2, 4)  # the guard is gone


def test_training_on_after_a_pause_matches_training_without_it() -> None:
    (paused, paused_chunks), (straight, straight_chunks) = build(), build()
    sleeper = sleep_wake_for(paused)
    for step in range(3):
        adam_step(paused, step)
        adam_step(straight, step)
        sleeper.sleep(optimizer=True, grads=True, params=True)
        sleeper.wake()
    for a, b in zip(snapshot(paused, paused_chunks), snapshot(straight, straight_chunks), strict=True):
        assert torch.equal(a, b)


def test_sleep_is_refused_mid_step_and_while_a_collective_is_in_flight() -> None:
    optimizer, chunks = build()
    adam_step(optimizer, 0)
    refused: list[str] = []

    def step_that_sleeps() -> None:  # what a hook inside the step would do
        with pytest.raises(SleepError) as error:
            sleep_wake_for(optimizer).sleep(grads=True)
        refused.append(str(error.value))

    optimizer.step = step_that_sleeps
    sleeper = sleep_wake_for(optimizer)
    optimizer.step()
    assert refused == ["cannot sleep in the middle of optimizer.step(): call sleep() between training steps"]

    chunks[1].bucket_groups[0].grad_reduce_handle = object()  # an async reduce-scatter not yet waited for
    with pytest.raises(SleepError, match="while a gradient reduce-scatter is in flight"):
        sleeper.sleep(grads=True)
    assert chunks[1].buffers[0].grad_data.untyped_storage().nbytes() > 0 and not sleeper.is_asleep


def test_params_need_the_distributed_optimizers_param_buffers() -> None:
    chunk = ddp_chunk(0, with_param_buffer=False)
    optimizer = ChainedOptimizer([dist_opt(chunk)])
    with pytest.raises(SleepError, match="params=True needs DDP param buffers: build with the distributed optimizer"):
        sleep_wake_for(optimizer).sleep(params=True)


def test_the_rl_loops_calls_become_sleep_and_wake_and_repeat_safely() -> None:
    optimizer, chunks = build()
    adam_step(optimizer, 0)
    before = snapshot(optimizer, chunks)
    sleeper = route_rl_offload_through_sleep(optimizer, chunks)
    optimizer.restore_from_cpu()  # awake: nothing to bring back, as megatron-core's own
    optimizer.offload_to_cpu()
    assert sleeper.is_asleep and sleeper.sleeper.asleep == ("optimizer",)
    assert all(o.is_offloaded for o in sleeper.sleeper.offloaders)
    optimizer.offload_to_cpu()  # already on the host: nothing more to do
    optimizer.restore_from_cpu()
    assert not sleeper.is_asleep
    for a, b in zip(snapshot(optimizer, chunks), before, strict=True):
        assert torch.equal(a, b)


def test_close_unwraps_the_step_and_the_next_sleeper_is_new() -> None:
    optimizer, _ = build()
    adam_step(optimizer, 0)
    sleeper = sleep_wake_for(optimizer)
    sleeper.sleep(grads=True)
    sleeper.close()
    assert "step" not in vars(optimizer) and not sleeper.is_asleep
    assert sleep_wake_for(optimizer) is not sleeper


def test_close_puts_back_a_step_wrapper_that_was_there_before() -> None:
    optimizer, _ = build()
    calls: list[str] = []

    def wrapped_step() -> None:  # as an attached OffloadHandle wraps the instance's step
        calls.append("step")

    optimizer.step = wrapped_step
    sleeper = sleep_wake_for(optimizer)
    optimizer.step()
    sleeper.close()
    assert optimizer.step is wrapped_step and calls == ["step"]


def test_prepare_pins_each_part_once_and_the_first_sleep_pins_nothing() -> None:
    optimizer, chunks = build()
    sleeper = sleep_wake_for(optimizer)
    report = sleeper.prepare(optimizer=True, grads=True, params=True)  # at setup: no Adam state yet
    pinned = {t.part: t.nbytes for t in report.transfers}
    grads = sum(c.buffers[0].grad_data.numel() * 4 for c in chunks)
    assert pinned["optimizer"] > 0 and pinned["grads"] >= grads and pinned["params"] >= grads // 2
    assert sleeper.sleeper.host_bytes_needed(["optimizer", "grads", "params"]) == 0
    adam_step(optimizer, 0)
    before = snapshot(optimizer, chunks)
    assert sleeper.sleep(optimizer=True, grads=True, params=True).pinned == []
    sleeper.wake()
    for a, b in zip(snapshot(optimizer, chunks), before, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(SleepError, match="params=True needs DDP param buffers"):
        sleep_wake_for(ChainedOptimizer([dist_opt(ddp_chunk(1, with_param_buffer=False))])).prepare(params=True)


def test_with_offload_optimizer_states_the_state_is_pinned_once_for_both() -> None:
    """The attached handle's offloaders and slab serve the sleep: nothing of the state is pinned again."""
    optimizer, chunks = build()
    adam_step(optimizer, 0)
    handle = attach_offloader(optimizer)
    sleeper = sleep_wake_for(optimizer)
    assert sleeper.sleeper.offloaders == handle.offloaders  # the same objects, so the same host slab
    report = sleeper.prepare(optimizer=True, grads=True)
    assert {t.part: t.nbytes for t in report.transfers}["optimizer"] == 0
    assert sleeper.sleep(optimizer=True, grads=True).pinned == []
    assert all(o.is_offloaded for o in handle.offloaders)
    back = sleeper.wake()
    assert {t.part: t.nbytes for t in back.transfers}["optimizer"] == 0  # the handle's next step brings it back
    sleeper.close()
    handle.detach()


def test_the_offloading_side_never_imports_the_sleep_side() -> None:
    """megatron_sleep imports megatron_adapter; the reverse would make an import circle."""
    import ast
    import inspect

    from megatron_offload.megatron import optimizer_adapter as megatron_adapter

    tree = ast.parse(inspect.getsource(megatron_adapter))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "megatron_offload.megatron.optimizer_adapter" not in imported  # sanity: the walk sees module names
    assert "megatron_offload.optimizer_state.offloader" in imported
    sleep_side = {
        "megatron_offload.megatron.ddp_chunks",
        "megatron_offload.megatron.sleep_hooks",
        "megatron_offload.sleep.parts",
        "megatron_offload.sleep.report",
        "megatron_offload.sleep.sleeper",
    }
    assert not sleep_side & imported
