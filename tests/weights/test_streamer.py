"""Weight streaming without a GPU: a stack of layers under reentrant activation checkpointing (forward
without grad, recompute in backward, as megatron-core's full recompute), gradients accumulated into
``main_grad`` by a hook on each parameter's AccumulateGrad node (as megatron-core's DDP does), weights
and gradients in flat host buffers. Streamed and not streamed must give the same bits, across
micro-batches, and the slots must be reused only as the schedule allows."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron_offload.core.streams import HostStreams
from megatron_offload.weights.plan import Placed, Run, Schedule, Unit, runs_of
from megatron_offload.weights.streamer import WeightStreamer

HIDDEN, LAYERS, VOCAB = 16, 5, 11


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Model(torch.nn.Module):
    """embedding -> checkpointed blocks -> head: the first and last stay resident, the blocks stream."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


def to_flat_buffers(model: Model, align: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Every param becomes a view of one weight buffer, with a main_grad view of one gradient buffer
    (the blocks padded apart, as megatron-core aligns params; ``align``: each starting on a multiple of that
    many elements), accumulated by an AccumulateGrad hook."""
    params = list(model.parameters())
    spans, cursor = {}, 0
    for param in params:
        spans[param] = (cursor, cursor + param.numel())
        cursor += param.numel() + 3 if align is None else -(-(param.numel() + 1) // align) * align
    weights, grads = torch.zeros(cursor), torch.zeros(cursor)
    for param in params:
        start, end = spans[param]
        weights[start:end].copy_(param.data.flatten())
        param.data = weights[start:end].view(param.shape)
        param.main_grad = grads[start:end].view(param.shape)
        accumulate = param.expand_as(param).grad_fn.next_functions[0][0]

        def hook(*_: object, param: torch.nn.Parameter = param) -> None:
            param.main_grad.add_(param.grad)
            param.grad = None

        accumulate.register_hook(hook)
        param._keep = accumulate  # the node must outlive the hook
    return weights, grads, spans


def unit_of(
    name: str, index: int, params: list, weights, grads, spans, resident: bool = False, max_gap: int = 8
) -> Unit:
    ranges = runs_of([spans[p] for p in params], max_gap=max_gap)
    runs, placed, start = [], [], 0
    for lo, hi in ranges:
        runs.append(Run(weights[lo:hi], grads[lo:hi], start))
        for p in params:
            if lo <= spans[p][0] < hi:
                placed.append(Placed(p, start + spans[p][0] - lo, p.data, p.main_grad))
        start += hi - lo
    return Unit(name, index, placed, runs, resident=resident, weights_dtype=weights.dtype, grads_dtype=grads.dtype)


def streamed(model: Model, weight_slots: int = 3) -> tuple[WeightStreamer, torch.Tensor]:
    weights, grads, spans = to_flat_buffers(model)
    layers = [unit_of(f"block{i}", i, list(b.parameters()), weights, grads, spans) for i, b in enumerate(model.blocks)]
    rest = list(model.embedding.parameters()) + list(model.head.parameters())
    resident = unit_of("resident", -1, rest, weights, grads, spans, resident=True)
    streamer = WeightStreamer(layers, resident, HostStreams(), weight_slots=weight_slots)
    for i, block in enumerate(model.blocks):

        def pre(module, args, i=i):
            streamer.before_forward(i, torch.is_grad_enabled(), args[0])

        def post(module, args, output, i=i):
            streamer.after_forward(i, torch.is_grad_enabled())

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    model.embedding.register_forward_pre_hook(lambda *_: streamer.lend_resident())
    return streamer, grads


def batches(step: int, micro_batches: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randint(0, VOCAB, (2, 7), generator=generator) for _ in range(micro_batches)]


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_streamed_gradients_and_losses_equal_unstreamed_bitwise(micro_batches: int) -> None:
    reference, model = Model(), Model()
    _, reference_grads, _ = to_flat_buffers(reference)
    streamer, grads = streamed(model)
    for step in range(2):
        reference_grads.zero_()
        grads.zero_()
        streamer.settle()
        for tokens in batches(step, micro_batches):
            expected = reference(tokens)
            expected.backward()
            loss = model(tokens)
            loss.backward()
            assert torch.equal(loss, expected)
        streamer.settle()
        assert torch.equal(grads, reference_grads), "gradients accumulated across micro-batches differ"
        assert grads.abs().sum() > 0
        with torch.no_grad():  # an optimizer step on the host copies, which the next step must see
            for ref, ours in zip(reference.parameters(), model.parameters(), strict=True):
                ref.sub_(0.1 * ref.main_grad)
                ours.sub_(0.1 * ours.main_grad)


def test_params_point_at_their_host_copies_between_uses() -> None:
    model = Model()
    streamer, _ = streamed(model)
    homes = {id(p): p.data.data_ptr() for p in model.parameters()}
    model(batches(0, 1)[0]).backward()
    streamer.settle()
    assert all(p.data.data_ptr() == homes[id(p)] for p in model.parameters())
    assert all(not unit.lent for unit in streamer.layers) and not streamer.resident.lent
    assert all(slot.unit is None for slot in streamer.weights.slots + streamer.grads.slots)


def test_the_last_layers_forward_slots_serve_their_backward() -> None:
    """Copies in: each layer once for its forward; in backward only the layers whose slot was reused."""
    model = Model()
    streamer, _ = streamed(model)
    unit_bytes = streamer.layers[0].nbytes
    before = streamer.stats.bytes_in
    model(batches(0, 1)[0]).backward()
    copied = (streamer.stats.bytes_in - before - streamer.resident.nbytes) // unit_bytes
    # forward: 5 layers; backward: 5 layers less the 3 still held by the 3 slots (layers 2, 3, 4)
    assert copied == LAYERS + LAYERS - 3


def test_schedule_distances_follow_forward_then_backward() -> None:
    schedule = Schedule(3)  # F0 F1 F2 B2 B1 B0
    assert [schedule.layer_at(p) for p in range(7)] == [
        (0, False),
        (1, False),
        (2, False),
        (2, True),
        (1, True),
        (0, True),
        (0, False),
    ]
    now = schedule.position(2, backward=False)
    assert schedule.distance(2, now) == 1  # its recompute comes next
    assert schedule.distance(1, now) == 2
    assert schedule.distance(0, now) == 3


def test_runs_bridge_small_gaps_only() -> None:
    assert runs_of([(10, 20), (0, 8), (40, 50)], max_gap=4) == [(0, 20), (40, 50)]
