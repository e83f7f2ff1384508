"""Streams whose events complete only when a test says so, and offloaders over them: helpers of
test_copy_points.py and test_copies_back.py."""

from __future__ import annotations

import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.core.streams import HostStreams
from tests.gates import Gate


class ManualStreams(HostStreams):
    """Copies happen at once (host memory), but their events and the compute marks complete by hand."""

    def __init__(self) -> None:
        self.marks: list[Gate] = []
        self.started: list[tuple[str, Gate]] = []

    def mark(self) -> Gate:
        self.marks.append(Gate())
        return self.marks[-1]

    def copy(self, direction, pairs, after):
        super().copy(direction, pairs, after)
        self.started.append((direction, Gate()))
        return None, self.started[-1][1]

    def open_all(self) -> None:
        for gate in self.marks + [gate for _, gate in self.started]:
            gate.open = True


def offloader_with(streams: ManualStreams, count: int = 6) -> tuple[OptimizerStateOffloader, list[torch.Tensor]]:
    masters = [torch.nn.Parameter(torch.randn(300)) for _ in range(count)]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    for master in masters:
        master.grad = torch.randn(300)
    optimizer.step()
    offloader = OptimizerStateOffloader(
        optimizer, masters, chunk_bytes=3000, pin_memory=False, check_host_memory=False, streams=streams
    )
    return offloader, masters


def offloaded_once(streams: ManualStreams) -> tuple[OptimizerStateOffloader, list[torch.Tensor]]:
    """An offloader whose state went out once and landed, every copy gate open."""
    offloader, masters = offloader_with(streams)
    offloader.offload()
    streams.open_all()
    offloader.copies.drain()
    offloader.wait()
    streams.open_all()
    return offloader, masters
