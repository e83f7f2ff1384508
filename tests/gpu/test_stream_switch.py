"""The streams' switch on a GPU: the stream it names is current inside, the one before it after, also nested, on
another thread and where the stream is current already; a copy queued through it lands."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_offload.core.streams import OFFLOAD, PREFETCH, CudaStreams

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_the_named_stream_is_current_inside_and_the_one_before_after() -> None:
    streams = CudaStreams(torch.device("cuda", torch.cuda.current_device()))
    out, back = streams.side[OFFLOAD], streams.side[PREFETCH]
    before = torch.cuda.current_stream()
    with streams.on(out):
        assert torch.cuda.current_stream() == out
        with streams.on(back):
            assert torch.cuda.current_stream() == back
        assert torch.cuda.current_stream() == out
        with streams.on(out):  # current already: nothing to switch, nothing to put back
            assert torch.cuda.current_stream() == out
        assert torch.cuda.current_stream() == out
    assert torch.cuda.current_stream() == before


def test_the_stream_before_comes_back_after_an_error_inside() -> None:
    streams = CudaStreams(torch.device("cuda", torch.cuda.current_device()))
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="inside"), streams.on(streams.side[OFFLOAD]):
        raise RuntimeError("inside")
    assert torch.cuda.current_stream() == before


def test_a_thread_switches_its_own_current_stream_only() -> None:
    streams = CudaStreams(torch.device("cuda", torch.cuda.current_device()))
    seen: list[bool] = []

    def other() -> None:
        with streams.on(streams.side[PREFETCH]):
            seen.append(torch.cuda.current_stream() == streams.side[PREFETCH])
        seen.append(torch.cuda.current_stream() != streams.side[PREFETCH])

    with streams.on(streams.side[OFFLOAD]):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert torch.cuda.current_stream() == streams.side[OFFLOAD]
    assert seen == [True, True]


def test_a_copy_queued_through_it_lands_and_the_compute_stream_is_current_after() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    streams = CudaStreams(device)
    source = torch.arange(1 << 20, dtype=torch.float32, device=device)
    host = torch.empty(1 << 20, dtype=torch.float32, pin_memory=True)
    began, done = streams.copy(OFFLOAD, [(host, source)], streams.mark())
    assert torch.cuda.current_stream() == streams.compute  # put back after the copy was queued
    done.synchronize()
    assert torch.equal(host, source.cpu())
    assert began.elapsed_time(done) >= 0
    block = streams.block(4096)
    assert block.device == device and block.numel() == 4096
