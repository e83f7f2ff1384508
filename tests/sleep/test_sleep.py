"""Sleep and wake at the engine level, on CPU tensors and real torch optimizers.

On CPU "device" and host are both memory, so what these prove is the bookkeeping: every byte comes
back where it was, tensor objects and views keep their identity, storages are really freed, and every
refusal happens before anything moves; host memory and ``prepare()`` are test_prepare.py's. The GPU test
does the rest.
"""

from __future__ import annotations

import pytest
import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.core.copies import CopyError, CopyQueue
from megatron_offload.core.streams import HostStreams
from megatron_offload.sleep import parts
from megatron_offload.sleep.report import SleepError, SleepReport
from megatron_offload.sleep.sleeper import Sleeper, Transfer


def adam_with_masters(seed: int = 0) -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    masters = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in (37, 1000, 5)]
    return torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1), masters


def take_step(optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()


class Setup:
    """An optimizer with masters, a flat grad buffer with two views, a flat bf16 param buffer."""

    def __init__(self, seed: int = 0) -> None:
        self.optimizer, self.masters = adam_with_masters(seed)
        self.grads = torch.randn(300, generator=torch.Generator().manual_seed(seed + 1))
        self.grad_views = [self.grads[:100], self.grads[100:]]  # like param.main_grad
        self.params = torch.randn(64, generator=torch.Generator().manual_seed(seed + 2)).bfloat16()

    def sleeper(self, **kwargs) -> Sleeper:
        offloader = OptimizerStateOffloader(self.optimizer, self.masters, pin_memory=False, check_host_memory=False)
        buffers = {"grads": [self.grads, *self.grad_views], "params": [self.params]}
        return Sleeper([offloader], buffers, pin_memory=False, chunk_bytes=512, **kwargs)

    def snapshot(self) -> list[torch.Tensor]:
        state = [v.clone() for p in self.masters for v in self.optimizer.state[p].values()]
        return [m.detach().clone() for m in self.masters] + state + [self.grads.clone(), self.params.clone()]


def assert_equal(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_sleep_frees_every_part_and_wake_brings_it_back_bitwise() -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    before = setup.snapshot()
    view = setup.grad_views[1]
    sleeper = setup.sleeper()

    report = sleeper.sleep(["optimizer", "grads", "params"])
    assert sleeper.asleep == ("optimizer", "grads", "params")
    assert setup.grads.untyped_storage().nbytes() == 0 and setup.params.untyped_storage().nbytes() == 0
    state_bytes = sum(v.numel() * 4 for p in setup.masters for k, v in setup.optimizer.state[p].items() if k != "step")
    master_bytes = sum(m.numel() * 4 for m in setup.masters)
    moved = {t.part: t.nbytes for t in report.transfers}
    assert moved["grads"] == 300 * 4 and moved["params"] == 64 * 2  # the views did not count twice
    assert moved["optimizer"] >= state_bytes + master_bytes
    assert sleeper.offloaders[0].is_offloaded

    back = sleeper.wake()
    assert not sleeper.is_asleep and back.nbytes == report.nbytes
    assert_equal(setup.snapshot(), before)
    assert view is setup.grad_views[1] and torch.equal(view, before[-2][100:])  # the old view sees the bytes
    view.add_(1.0)  # and it is a view again: writes land in the buffer
    assert torch.equal(setup.grads[100:], before[-2][100:] + 1.0)


def test_training_on_after_sleep_and_wake_matches_training_without_the_pause() -> None:
    paused, straight = Setup(), Setup()
    sleeper = paused.sleeper()
    for step in range(4):
        take_step(paused.optimizer, step)
        take_step(straight.optimizer, step)
        sleeper.sleep(["optimizer", "grads", "params"])
        sleeper.wake()
    assert_equal(paused.snapshot(), straight.snapshot())


def test_only_the_parts_asked_for_move() -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    sleeper = setup.sleeper()
    report = sleeper.sleep(["grads"])
    assert [t.part for t in report.transfers] == ["grads"]
    assert setup.params.untyped_storage().nbytes() == 64 * 2
    assert not sleeper.offloaders[0].is_offloaded
    sleeper.wake()
    assert sleeper.buffers["params"].slab is None  # never pinned for a part never slept


def test_state_that_lives_on_the_host_stays_there_at_wake() -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    sleeper = setup.sleeper(state_lives_on_host=True)
    sleeper.sleep(["optimizer"])
    back = sleeper.wake()
    assert back.transfers[0].nbytes == 0
    assert sleeper.offloaders[0].is_offloaded  # the handle's next step brings it back, as after any step


def test_refusals_say_what_and_what_to_do_and_move_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    before = setup.snapshot()
    reason: list[str] = ["in the middle of optimizer.step()"]
    sleeper = setup.sleeper(busy=lambda: reason[0] if reason else None)

    with pytest.raises(SleepError, match="wake\\(\\) follows a sleep"):
        sleeper.wake()
    with pytest.raises(SleepError, match=r"cannot sleep in the middle of optimizer.step\(\): call sleep\(\) between"):
        sleeper.sleep()
    reason.clear()
    with pytest.raises(SleepError, match="cannot sleep \\['kv_cache'\\]: choose among optimizer, grads, params"):
        sleeper.sleep(["kv_cache"])
    monkeypatch.setattr(parts, "available_host_bytes", lambda: 1000)  # the host reports 1000 bytes free
    with pytest.raises(SleepError, match="new pinned host memory.*sleep fewer parts or free host memory"):
        sleeper.sleep(["optimizer", "grads"])
    assert not sleeper.is_asleep and not sleeper.offloaders[0].is_offloaded
    assert all(part.slab is None for part in sleeper.buffers.values())
    assert_equal(setup.snapshot(), before)  # nothing moved, nothing freed

    monkeypatch.undo()
    sleeper.sleep(["grads"])
    with pytest.raises(SleepError, match="already asleep \\(grads\\): call wake\\(\\) before sleeping again"):
        sleeper.sleep(["params"])
    assert setup.params.untyped_storage().nbytes() == 64 * 2  # the refused second sleep moved nothing
    sleeper.wake()
    assert_equal(setup.snapshot(), before)


def test_close_gives_the_state_storage_of_its_own_and_frees_the_slabs() -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    before = setup.snapshot()
    sleeper = setup.sleeper()
    sleeper.sleep(["optimizer", "grads", "params"])
    sleeper.close()
    assert not sleeper.is_asleep and all(part.slab is None for part in sleeper.buffers.values())
    for master in setup.masters:
        assert master.untyped_storage().nbytes() == master.numel() * 4  # not a view into a chunk block
    assert_equal(setup.snapshot(), before)


def test_a_buffer_freed_by_someone_else_is_refused_before_anything_moves() -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    sleeper = setup.sleeper()
    setup.grads.untyped_storage().resize_(0)  # as megatron-core's offload_grad_buffers() leaves it
    with pytest.raises(SleepError, match="cannot sleep grads: a buffer was freed or resized by someone else"):
        sleeper.sleep(["optimizer", "grads"])
    assert not sleeper.is_asleep and not sleeper.offloaders[0].is_offloaded


def test_reports_time_every_part_and_wake_brings_the_smallest_buffer_first() -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    sleeper = setup.sleeper()
    sleeper.prepare(["optimizer", "grads", "params"])
    asleep = sleeper.sleep(["optimizer", "grads", "params"])
    assert [t.part for t in asleep.transfers] == ["grads", "params", "optimizer"]  # buffers, then the engine's
    awake = sleeper.wake()
    assert [t.part for t in awake.transfers] == ["params", "grads", "optimizer"]  # params are the smaller buffer
    for report in (asleep, awake):
        assert all(t.seconds > 0 and t.gb_per_s > 0 for t in report.transfers)
        assert report.seconds >= max(t.seconds for t in report.transfers)
    assert [t.nbytes for t in awake.transfers] == [128, 1200, asleep.transfers[2].nbytes]


def test_a_reports_line_says_what_moved_and_what_the_allocator_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    report = SleepReport(
        "sleep",
        [Transfer("optimizer", 3_000_000_000, 0.06), Transfer("grads", 1_000_000_000, 0.02)],
        seconds=0.1,
        device_free_before=10_000_000_000,
        device_free_after=13_800_000_000,
        allocated_after=5_000_000_000,
        reserved_after=5_200_000_000,
    )
    assert report.given_back == 3_800_000_000 and report.held_by_allocator == 200_000_000
    assert report.describe() == (
        "4.00 GB in 0.100 s (40.0 GB/s wall; optimizer 3.00 GB at 50.0 GB/s, grads 1.00 GB at 50.0 GB/s); the "
        "device got 3.80 GB back (95% of what moved), 0.20 GB stays with PyTorch's allocator (free, but in pages "
        "shared with live tensors)"
    )
    prepared = SleepReport("prepare", [Transfer("grads", 2_000_000_000, 1.0)], seconds=1.0)
    assert prepared.describe() == "pinned host memory for sleep: grads 2.00 GB at 2.0 GB/s (1.00 s)"


class FailingStreams(HostStreams):
    """Copies that fail as they start, like a CUDA error on the side stream."""

    def copy(self, direction, pairs, after):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failed_buffer_copy_names_the_part_and_frees_nothing() -> None:
    """The buffers' copies go through the copy core: a failure is named there, before any storage is freed."""
    setup = Setup()
    sleeper = setup.sleeper()
    sleeper._copies = CopyQueue(FailingStreams())
    with pytest.raises(CopyError, match="copy failed: sleep's grads buffers, GPU to host \\(RuntimeError: CUDA"):
        sleeper.sleep(["grads"])
    assert not sleeper.is_asleep and setup.grads.untyped_storage().nbytes() == 300 * 4
    assert sleeper.copies.idle
