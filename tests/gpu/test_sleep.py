"""Sleep, hand the GPU to a stand-in inference engine, wake, train on: bitwise what training without the
pause gives. A real megatron-core GPT (DDP, distributed optimizer in a ChainedOptimizer, bf16).

The stand-in is another process that takes all the device memory it can get and writes a pattern over
it: any tensor of ours still pointing at freed memory would read that pattern, and any memory the sleep
failed to give back is memory the other process could not get.
    PYTHONPATH=$PWD:$MEGATRON python -m pytest -q tests/gpu/test_sleep.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA GPU: these tests train a megatron-core GPT and hand its memory over", allow_module_level=True
    )
pytest.importorskip("megatron.core", reason="needs megatron-core installed (scripts/device_check.sh does it)")

from megatron_offload import SleepError, attach_offloader, sleep_wake_for  # noqa: E402
from megatron_offload.core.gpu_memory import EXPANDABLE_PAGE_BYTES, expandable_segments_from_now  # noqa: E402
from megatron_offload.megatron.optimizer_adapter import distributed_optimizers  # noqa: E402
from tests.gpu.harness import GPTShape, GPTTraining, build_gpt_training, init_distributed, state_bytes  # noqa: E402

# Big enough that every large tensor has device segments of its own (the caching allocator shares
# segments between tensors under 10 MiB), so the freed-memory check measures our bytes, not rounding.
SHAPE = GPTShape(num_layers=2, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, vocab_size=8192)
# The state alone (3.2 GB): large against the allocator's pages (20 MiB with expandable segments), of
# which the two at the edges of a run of freed blocks may stay shared with live tensors.
LARGE_STATE = GPTShape(num_layers=4, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, vocab_size=32768)
STEPS = 6
PAUSES = (2, 4)  # sleep after these iterations: the second reuses the host slabs of the first
MIB = 1024**2

# Another process (its own CUDA context and allocator) takes all it can, writes 0xA5 over it, frees it.
FILL = """
import sys, torch
free, _ = torch.cuda.mem_get_info()
block = torch.empty(free - 256 * 2**20, dtype=torch.uint8, device="cuda")
block.fill_(0xA5)
torch.cuda.synchronize()
print(block.numel())
"""


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    # Memory goes back to the device only from segments the allocator can release piece by piece: the
    # expandable segments our launcher, attach_offloader, sleep_wake_for and RL frameworks turn on. Earlier
    # test modules of this process may have started CUDA with fixed segments: turn them on before building.
    expandable_segments_from_now()
    init_distributed()


def snapshot(training: GPTTraining) -> dict[str, torch.Tensor]:
    """Model params, fp32 masters and every Adam tensor the shape of its param (cloned)."""
    tensors = {f"model.{n}": p.detach().clone() for n, p in training.model[0].named_parameters()}
    for index, dist_opt in enumerate(distributed_optimizers(training.optimizer)):
        for i, master in enumerate(m for group in dist_opt.shard_fp32_from_float16_groups for m in group):
            tensors[f"opt{index}.master.{i}"] = master.detach().clone()
        params = [p for group in dist_opt.optimizer.param_groups for p in group["params"]]
        for i, param in enumerate(params):
            for key, value in dist_opt.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    tensors[f"opt{index}.{i}.{key}"] = value.detach().clone()
    return tensors


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    training = build_gpt_training(SHAPE)
    losses = [training.train_step(iteration)[0] for iteration in range(STEPS)]
    return losses, snapshot(training)


def hand_the_gpu_over() -> int:
    """Run the stand-in inference engine; returns the bytes it took."""
    done = subprocess.run([sys.executable, "-c", FILL], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"the stand-in could not take the freed memory: {done.stderr[-2000:]}"
    return int(done.stdout.strip())


@pytest.mark.parametrize("with_handle", [False, True], ids=["plain", "offload-optimizer-states"])
def test_train_sleep_fill_wake_train_is_bitwise_training_without_the_pause(
    reference: tuple[list[float], dict[str, torch.Tensor]], with_handle: bool
) -> None:
    expected_losses, expected = reference
    training = build_gpt_training(SHAPE)
    handle = attach_offloader(training.optimizer) if with_handle else None
    sleeper = sleep_wake_for(training.optimizer)
    prepared = sleeper.prepare(optimizer=True, grads=True, params=True)  # at setup, before training
    pinned = {t.part: t.nbytes for t in prepared.transfers}
    assert pinned["grads"] > 0 and pinned["params"] > 0
    # With --offload-optimizer-states the state's slab is the handle's: nothing is pinned for it twice.
    assert (pinned["optimizer"] == 0) == with_handle
    losses = []
    for iteration in range(STEPS):
        losses.append(training.train_step(iteration)[0])
        if iteration not in PAUSES:
            continue
        torch.cuda.synchronize()
        report = sleeper.sleep(optimizer=True, grads=True, params=True)
        assert report.pinned == []  # prepared: the first sleep pins nothing on the way
        assert all(t.seconds > 0 for t in report.transfers if t.nbytes)
        rose = report.device_free_after - report.device_free_before
        held = f"{report.held_by_allocator / MIB:.0f} MiB held by the allocator (pages live tensors share)"
        moved = f"free memory rose {rose / MIB:.0f} MiB for {report.nbytes / MIB:.0f} MiB"
        assert report.allocated_before - report.allocated_after >= report.nbytes, moved  # every byte moved freed
        # What the device did not get back stays, free, with the allocator: at most the two pages at the edges
        # of each part's freed blocks, shared with live tensors (a few percent of this small model's bytes).
        short = report.nbytes - rose
        edges = 2 * EXPANDABLE_PAGE_BYTES * len(report.transfers)
        assert short <= report.held_by_allocator and short <= edges, f"{moved}, {held}"
        with pytest.raises(SleepError, match="gradient buffers are asleep"):
            training.train_step(iteration)  # refused before it touches a freed buffer
        taken = hand_the_gpu_over()
        assert taken >= report.device_free_after - 1024 * MIB  # the other process got what we gave back
        back = sleeper.wake()
        assert [t.part for t in back.transfers] == ["params", "grads", "optimizer"]  # smallest buffer first
        assert {t.part: t.nbytes for t in back.transfers if t.part != "optimizer"} == {
            t.part: t.nbytes for t in report.transfers if t.part != "optimizer"
        }
    assert losses == expected_losses
    if handle is not None:
        handle.wait()  # with offloading, the state lives on the host between steps: compare it on the GPU
    actual = snapshot(training)
    assert actual.keys() == expected.keys() and any("exp_avg_sq" in key for key in actual)
    different = [key for key in expected if not torch.equal(expected[key], actual[key])]
    assert not different, f"{len(different)} tensors differ after the pauses, e.g. {different[:3]}"
    sleeper.close()
    if handle is not None:
        handle.detach()


def test_the_optimizer_state_alone_gives_back_what_the_allocator_can() -> None:
    """The RL default (optimizer state and masters only). The claim (docs/sleep-wake.md): a sleep frees
    every byte it moves and the device gets back all of it that PyTorch's allocator can release. The
    first sleep after Adam's first step frees the tensors the optimizer made, wherever it put them: the
    allocator keeps pages they share with live tensors, and the report says how much. Later sleeps free
    the blocks the wake put the state in: at least 95% of what moved goes back to the device."""
    training = build_gpt_training(LARGE_STATE)
    sleeper = sleep_wake_for(training.optimizer)
    sleeper.prepare()  # the state's slab, sized for the moments Adam's first step will make
    training.train_step(0)
    torch.cuda.synchronize()
    first = sleeper.sleep()
    assert first.pinned == [] and first.nbytes >= state_bytes(training)  # fp32 master, exp_avg, exp_avg_sq
    assert first.allocated_before - first.allocated_after >= first.nbytes  # every byte moved was freed
    # What did not reach the device is held, free, by the allocator (pages shared with live tensors).
    assert first.given_back + first.held_by_allocator >= 0.99 * first.nbytes
    print(f"\nfirst sleep of the state alone: {first.describe()}")
    sleeper.wake()
    training.train_step(1)
    torch.cuda.synchronize()
    second = sleeper.sleep()
    print(f"second sleep of the state alone: {second.describe()}")
    assert second.nbytes == first.nbytes
    assert second.given_back >= 0.95 * second.nbytes, second.describe()
    sleeper.wake()
    training.train_step(2)
    sleeper.close()
