"""Whether the forward may pace copies out: every segment of the allocator's default pool expandable.
The snapshot is the test's (no GPU here); the function reads only its segments' two fields."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.core import gpu_memory


def segments(*entries: tuple[bool, tuple[int, int]]) -> dict:
    return {"segments": [{"is_expandable": e, "segment_pool_id": pool} for e, pool in entries]}


@pytest.fixture
def snapshot(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    holder: dict = {}

    def read() -> dict:
        if "error" in holder:
            raise holder["error"]
        return holder["value"]

    monkeypatch.setattr(torch.cuda.memory, "_snapshot", read)
    return holder


def test_all_expandable_in_the_default_pool_paces(snapshot) -> None:
    snapshot["value"] = segments((True, (0, 0)), (True, (0, 0)))
    assert gpu_memory.every_segment_remappable()


def test_one_fixed_size_segment_in_the_default_pool_does_not(snapshot) -> None:
    snapshot["value"] = segments((True, (0, 0)), (False, (0, 0)))
    assert not gpu_memory.every_segment_remappable()


def test_private_pools_are_left_out(snapshot) -> None:
    # The device-mapped host memory's pool: fixed-size, but activations and state never go there.
    snapshot["value"] = segments((True, (0, 0)), (False, (1, 2)))
    assert gpu_memory.every_segment_remappable()


def test_a_snapshot_that_cannot_be_read_says_no(snapshot) -> None:
    snapshot["error"] = AttributeError("no snapshot in this torch")
    assert not gpu_memory.every_segment_remappable()


def test_without_a_gpu_nothing_paces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not gpu_memory.every_segment_remappable()
