"""The engine's failures on CPU tensors: a gradient on the wrong device refused before anything moves,
an exception in the streamed step that leaves everything offloaded with each chunk's values whole, a bad
chunk size or fraction named, and a failed offload that points every tensor back at its GPU memory.
"""

from __future__ import annotations

import pytest
import torch

from megatron_offload import OffloadCopyError
from megatron_offload.core.streams import HostStreams
from tests.optimizer_state.cpu_engine import (
    adam_with_masters,
    entries,
    in_host_slab,
    many_masters,
    offloader_for,
    run_step,
    set_grads,
    take_step,
)


def test_a_gradient_on_the_wrong_device_is_refused_before_anything_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    set_grads(optimizer, 0)
    # The grads are on the CPU; pretend the step runs on a GPU (what the probe got wrong).
    monkeypatch.setattr(offloader.device_view, "device", torch.device("cuda", 0))
    chunks_before = [(not chunk.on_gpu) for chunk in offloader.chunks]
    with pytest.raises(ValueError, match=r"gradient is on cpu but its optimizer step runs on cuda:0"):
        run_step(offloader)
    assert [(not chunk.on_gpu) for chunk in offloader.chunks] == chunks_before


def test_exception_in_the_streamed_step_leaves_everything_offloaded() -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    before = {id(t): t.clone() for t in (e.tensor for e in entries(offloader))}
    calls = []

    def fail_on_third_chunk(params: list[torch.Tensor]) -> None:
        calls.append(params)
        if len(calls) == 3:
            raise RuntimeError("injected")

    set_grads(optimizer, 1)
    with pytest.raises(RuntimeError, match="injected"):
        run_step(offloader, fail_on_third_chunk)
    # Everything is leaving: out already, or queued for the next points, never half-way.
    assert all(not chunk.on_gpu or chunk.copy is not None for chunk in offloader.chunks)
    offloader.copies.drain()
    assert all(not chunk.on_gpu for chunk in offloader.chunks)
    offloader.wait()
    updated = {id(p) for params in calls for p in params}
    assert len(updated) < len(masters)  # the failure came before the last chunk
    for chunk in offloader.chunks:
        chunk_updated = any(id(p) in updated for p in chunk.params)
        for entry in chunk.entries:  # updated chunks kept their update, the others their old values
            assert torch.equal(entry.tensor, before[id(entry.tensor)]) != chunk_updated


def test_bad_chunk_size_and_fraction_name_the_parameter() -> None:
    optimizer, masters = adam_with_masters()
    with pytest.raises(ValueError, match="^OptimizerStateOffloader: chunk_bytes must be positive, got 0$"):
        offloader_for(optimizer, masters, chunk_bytes=0)
    with pytest.raises(ValueError, match="^OptimizerStateOffloader: fraction must be from 0 to 1, got 1.5$"):
        offloader_for(optimizer, masters, fraction=1.5)


def test_a_failed_offload_points_every_tensor_back_at_its_gpu_memory() -> None:
    class FailingOffloads(HostStreams):
        def copy(self, direction, pairs, after):
            if direction == "offload":
                raise RuntimeError("injected copy failure")
            return super().copy(direction, pairs, after)

    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, streams=FailingOffloads())
    take_step(optimizer, 0)  # the moments exist, each in storage of its own
    before = {id(t): t.clone() for p in masters for t in (p, *optimizer.state[p].values()) if t.dim()}
    with pytest.raises(OffloadCopyError, match=r"chunk 1 of \d+ .*GPU to host.*injected copy failure"):
        offloader.offload()
    failed = offloader.chunks[0]
    assert failed.on_gpu
    for entry in failed.entries:
        assert not in_host_slab(offloader, entry.tensor)  # back at the memory that still holds the values
        assert torch.equal(entry.tensor, before[id(entry.tensor)])
