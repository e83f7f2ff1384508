"""The layer-input offloader on the CPU: a stack of layers under reentrant checkpointing (the same
save_for_backward / saved_tensors path megatron-core's CheckpointFunction takes), with and without the
offloader, must give the same bits; only the layer inputs move, each once each way."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron_offload.activations.layer_inputs import LayerInputOffloader
from megatron_offload.core.streams import OFFLOAD, PREFETCH, Done, HostStreams
from tests.gates import Gate


class Layer(torch.nn.Module):
    def __init__(self, width: int, offloader: LayerInputOffloader | None) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)
        self.offloader = offloader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.offloader is not None and not torch.is_grad_enabled():  # as the adapter's pre-hook does
            self.offloader.note_input(hidden)
        return hidden + torch.tanh(self.fc(self.norm(hidden)))


def run(layers: int, offloader: LayerInputOffloader | None, seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    stack = torch.nn.ModuleList(Layer(16, offloader) for _ in range(layers))
    losses = []
    for step in range(steps):
        x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        hidden = x * 1.0
        if offloader is not None:
            offloader.begin_pass()
            with offloader.hooks():
                for layer in stack:
                    hidden = checkpoint(layer, hidden, use_reentrant=True)
            offloader.end_pass()
        else:
            for layer in stack:
                hidden = checkpoint(layer, hidden, use_reentrant=True)
        loss = hidden.square().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses, [p.grad.clone() for p in stack.parameters()]


@pytest.mark.parametrize("layers", [1, 2, 5])
def test_bitwise_as_without_offloading_and_each_input_moves_once(layers: int) -> None:
    plain_losses, plain_grads = run(layers, None)
    offloader = LayerInputOffloader(HostStreams(), pin=False)
    losses, grads = run(layers, offloader)
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
    stats = offloader.read_stats()
    # The pass's last input stays on the GPU: layers - 1 inputs out and back per step, two steps.
    assert stats.sent == stats.fetched == 2 * (layers - 1)
    one = 8 * 2 * 16 * 4
    assert stats.bytes_out == stats.bytes_in == 2 * (layers - 1) * one
    assert stats.host_bytes == (layers - 1) * one  # the second step reuses the first step's host buffers
    assert stats.gpu_slot_bytes <= 2 * one


def test_only_noted_inputs_move() -> None:
    offloader = LayerInputOffloader(HostStreams(), pin=False)
    other = torch.ones(4)
    assert offloader.pack(other) is other  # nothing noted: passes through
    noted = torch.ones(4)
    offloader.note_input(noted)
    offloader.note_input(torch.zeros(4))  # a second layer in the same checkpoint: the first one wins
    assert offloader.pack(other) is other
    assert offloader.pack(noted) is not noted  # the noted one becomes a handle
    assert offloader.unpack(other) is other


def test_a_sent_input_is_dropped_from_the_gpu_side() -> None:
    offloader = LayerInputOffloader(HostStreams(), pin=False)
    first, second = torch.arange(6.0), torch.arange(6.0) * 2
    gone = weakref.ref(first)
    offloader.begin_pass()
    offloader.note_input(first)
    handle_first = offloader.pack(first)
    offloader.note_input(second)
    handle_second = offloader.pack(second)  # sends the first: the offloader holds no GPU reference to it
    offloader.end_pass()
    del first
    assert gone() is None
    assert torch.equal(offloader.unpack(handle_second), torch.arange(6.0) * 2)  # kept on the GPU
    assert torch.equal(offloader.unpack(handle_first), torch.arange(6.0))  # fetched back
    assert offloader.read_stats().sent == 1


class DeferredStreams(HostStreams):
    """Copies that land only when the compute stream waits for them, like a device that lags the host."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, Gate, list]] = []
        self.log: list[str] = []

    def copy(self, direction, pairs, after):
        gate = Gate()
        self.pending.append((direction, gate, list(pairs)))
        self.log.append(direction)
        return None, gate

    def compute_waits(self, event):
        while self.pending:  # one stream per direction runs in order: land everything up to the event
            direction, gate, pairs = self.pending.pop(0)
            for destination, source in pairs:
                destination.copy_(source)
            gate.open = True
            if gate is event:
                break
        return None, None


def test_each_fetch_starts_one_layer_ahead_and_the_data_is_right_when_copies_lag() -> None:
    plain_losses, plain_grads = run(4, None, steps=1)
    streams = DeferredStreams()
    offloader = LayerInputOffloader(streams, pin=False)
    losses, grads = run(4, offloader, steps=1)
    assert torch.equal(plain_losses[0], losses[0])
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
    # Three inputs out during the forward, then back in reverse, each fetch queued one unpack ahead.
    assert streams.log == [OFFLOAD] * 3 + [PREFETCH] * 3


def test_timed_waits_are_folded_in_without_a_reader() -> None:
    """A Python-API user who never reads the figures does not accumulate the waits' events."""

    class Running(Done):
        def query(self) -> bool:
            return False  # reported as still copying: the compute stream must wait for it

    class TimedStreams(HostStreams):
        timed = True
        waits = 0

        def copy(self, direction, pairs, after):
            began, _ = super().copy(direction, pairs, after)
            return began, Running()

        def compute_waits(self, event):
            self.waits += 1
            return self.mark(timed=True), self.mark(timed=True)  # completed, with a time

    streams = TimedStreams()
    offloader = LayerInputOffloader(streams, pin=False)
    run(5, offloader, steps=80)  # 4 waits a step
    assert offloader.stats.fetched == streams.waits == 320
    assert len(offloader._waits._pending) <= 256


def test_an_input_already_back_is_not_waited_for() -> None:
    class CountingStreams(HostStreams):
        waits = 0

        def compute_waits(self, event):
            self.waits += 1
            return super().compute_waits(event)

    streams = CountingStreams()  # the CPU's copies have landed when they return
    offloader = LayerInputOffloader(streams, pin=False)
    run(5, offloader, steps=2)
    assert offloader.stats.fetched == 8 and streams.waits == 0


def test_the_pass_that_makes_host_buffers_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    offloader = LayerInputOffloader(HostStreams(), pin=False)
    run(5, offloader, steps=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if "layer inputs" in line]
    told = "megatron-offload: layer inputs hold 0.00 GiB of pageable host memory (4 buffers), made once and reused"
    assert lines == [told]
    assert offloader.read_stats().host_buffers == 4
    run(5, offloader, steps=1)  # the same buffers again: nothing new to tell
    assert "layer inputs" not in capsys.readouterr().err
