"""Sleep's host memory, at the engine level on CPU tensors: slabs pinned once, by ``prepare()`` at setup
or else by the first sleep (said in the log), never twice for state an attached handle already holds on
the host, and a prepare the host has no room for refused before anything is pinned.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_offload.core import host_memory
from megatron_offload.sleep import parts
from megatron_offload.sleep.report import SleepError
from tests.sleep.test_sleep import Setup, assert_equal, take_step


@pytest.fixture
def slabs_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every host slab made from now on (the engine's and the buffers' alike)."""
    made: list[int] = []
    real_init = host_memory.HostSlab.__init__

    def counting_init(self, numel: int, dtype: torch.dtype, *args, **kwargs) -> None:
        made.append(numel * torch.empty((), dtype=dtype).element_size())
        real_init(self, numel, dtype, *args, **kwargs)

    monkeypatch.setattr(host_memory.HostSlab, "__init__", counting_init)
    return made


def test_host_slabs_are_pinned_once_and_reused() -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    sleeper = setup.sleeper()
    sleeper.sleep(["optimizer", "grads", "params"])
    slabs = {name: part.slab for name, part in sleeper.buffers.items()}
    pointers = {name: slab.tensor.data_ptr() for name, slab in slabs.items()}
    sleeper.wake()
    assert sleeper.host_bytes_needed(["grads", "params", "optimizer"]) == 0  # nothing new to pin
    take_step(setup.optimizer, 1)
    sleeper.sleep(["optimizer", "grads", "params"])
    for name, part in sleeper.buffers.items():
        assert part.slab is slabs[name] and part.slab.tensor.data_ptr() == pointers[name]
    sleeper.wake()


def test_prepare_pins_every_slab_at_setup_and_no_sleep_pins_again(slabs_made: list[int]) -> None:
    """An RL framework prepares at setup, before Adam's first step has made the moments: the state's slab
    is sized for them, so neither the first sleep after that step nor any later one pins anything."""
    setup = Setup()
    sleeper = setup.sleeper()
    report = sleeper.prepare(["optimizer", "grads", "params"])
    pinned = {t.part: t.nbytes for t in report.transfers}
    assert report.direction == "prepare" and pinned["grads"] == 1280 and pinned["params"] == 256  # 256-aligned
    masters = sum(m.numel() * 4 for m in setup.masters)
    assert pinned["optimizer"] >= 3 * masters  # the masters and the two moments to come
    assert len(slabs_made) == 3 and sleeper.host_bytes_needed(["optimizer", "grads", "params"]) == 0
    assert not sleeper.offloaders[0].is_offloaded  # nothing moved
    assert sleeper.prepare(["grads"]).transfers[0].nbytes == 0 and len(slabs_made) == 3  # kept, not re-pinned

    straight = Setup()
    for step in range(3):
        take_step(setup.optimizer, step)
        take_step(straight.optimizer, step)
        asleep = sleeper.sleep(["optimizer", "grads", "params"])
        assert asleep.pinned == [] and len(slabs_made) == 3
        sleeper.wake()
    assert_equal(setup.snapshot(), straight.snapshot())


def test_a_sleep_that_was_not_prepared_pins_on_the_way_and_says_so(
    slabs_made: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    setup = Setup()
    take_step(setup.optimizer, 0)
    sleeper = setup.sleeper()
    sleeper.prepare(["grads"])
    with caplog.at_level(logging.WARNING, logger="megatron_offload.sleep.sleeper"):
        report = sleeper.sleep(["optimizer", "grads", "params"])
    assert [t.part for t in report.pinned] == ["optimizer", "params"] and len(slabs_made) == 3
    assert "pinned 0.00 GiB of host memory on the way" in caplog.text and "call prepare() at setup" in caplog.text
    sleeper.wake()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_offload.sleep.sleeper"):
        assert sleeper.sleep(["optimizer", "grads", "params"]).pinned == []
    assert caplog.text == "" and len(slabs_made) == 3


def test_state_that_lives_on_the_host_is_never_pinned_twice(slabs_made: list[int]) -> None:
    """With an attached handle the state's slab is the handle's: prepare and sleep pin nothing for it."""
    setup = Setup()
    take_step(setup.optimizer, 0)
    sleeper = setup.sleeper(state_lives_on_host=True)
    report = sleeper.prepare(["optimizer", "grads"])
    assert {t.part: t.nbytes for t in report.transfers} == {"optimizer": 0, "grads": 1280}
    assert slabs_made == [1280] and sleeper.host_bytes_needed(["optimizer"]) == 0


def test_prepare_refuses_before_pinning_anything(monkeypatch: pytest.MonkeyPatch, slabs_made: list[int]) -> None:
    sleeper = Setup().sleeper()
    with pytest.raises(SleepError, match="cannot prepare \\['kv_cache'\\]: choose among optimizer, grads, params"):
        sleeper.prepare(["kv_cache"])
    monkeypatch.setattr(parts, "available_host_bytes", lambda: 1000)
    with pytest.raises(SleepError, match="prepare needs 0.00 GiB of new pinned host memory but 0.00 GiB is available"):
        sleeper.prepare(["optimizer", "grads", "params"])
    assert slabs_made == [] and sleeper.host_bytes_needed(["grads"]) == 1280
