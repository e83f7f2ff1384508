"""Layer-major backward without a GPU: the toy model of test_streamer.py (reentrant checkpoints, DDP-like
``main_grad`` hooks, flat host buffers), its checkpoints cut and their backwards run layer by layer.
Gradients must equal the micro-batch-major run's bitwise, and each layer must come in and leave once per
step in backward."""

from __future__ import annotations

import pytest
import torch
from megatron.core.pipeline_parallel.schedules import custom_backward
from torch.utils.checkpoint import checkpoint

from megatron_offload.weights.layer_major import LayerMajorBackward
from megatron_offload.weights.plan import Schedule
from tests.weights.test_streamer import LAYERS, Block, Model, batches, streamed, to_flat_buffers


class CutModel(Model):
    """The toy model, its checkpoint function replaceable (as megatron-core's module attribute is)."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = self.checkpoint(block, x, use_reentrant=True)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


def layer_major(model: CutModel, micro_batches: int, weight_slots: int = 3):
    streamer, grads = streamed(model, weight_slots)
    deferred = LayerMajorBackward(streamer, custom_backward)
    model.checkpoint = deferred.wrap(checkpoint, input_at=0)
    position = {"micro_batch": 0}
    streamer.forward_again = lambda: position["micro_batch"] < micro_batches - 1
    return streamer, grads, deferred, position


def step(model, tokens_list, deferred=None, position=None) -> list[torch.Tensor]:
    losses = []
    for index, tokens in enumerate(tokens_list):
        if position is not None:
            position["micro_batch"] = index
        loss = model(tokens)
        loss.backward()
        losses.append(loss.detach())
    if deferred is not None:
        deferred.run()
    return losses


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_layer_major_gradients_and_losses_equal_micro_batch_major_bitwise(micro_batches: int) -> None:
    reference, model = Model(), CutModel()
    _, reference_grads, _ = to_flat_buffers(reference)
    streamer, grads, deferred, position = layer_major(model, micro_batches)
    for iteration in range(3):
        reference_grads.zero_()
        grads.zero_()
        streamer.new_step()
        tokens = batches(iteration, micro_batches)
        expected = step(reference, tokens)
        losses = step(model, tokens, deferred, position)
        streamer.settle()
        assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
        assert torch.equal(grads, reference_grads), "layer-major gradient sums differ"
        assert grads.abs().sum() > 0 and not deferred.pending
        with torch.no_grad():  # a step on the host copies, which the next forward must see
            for ref, ours in zip(reference.parameters(), model.parameters(), strict=True):
                ref.sub_(0.1 * ref.main_grad)
                ours.sub_(0.1 * ours.main_grad)


def test_each_layer_comes_in_once_and_leaves_once_in_backward() -> None:
    """Three micro-batches: weights in 3 times per layer for the forwards, at most once more for all three
    backwards; every layer's gradients out exactly once per step, never back in."""
    micro_batches = 3
    model = CutModel()
    streamer, _, deferred, position = layer_major(model, micro_batches)
    unit = streamer.layers[0]
    streamer.new_step()
    before_in, before_out = streamer.stats.bytes_in, streamer.stats.bytes_out
    step(model, batches(0, micro_batches), deferred, position)
    streamer.settle()
    layers_in = (streamer.stats.bytes_in - before_in - streamer.resident.nbytes) / unit.nbytes
    layers_out = streamer.stats.bytes_out - before_out - streamer.resident.grad_nbytes
    assert layers_in <= micro_batches * LAYERS + LAYERS
    assert layers_out == LAYERS * unit.grad_nbytes


def test_micro_batch_major_brings_gradient_sums_back() -> None:
    """The same step in the loop's order: the sums go out after every micro-batch and come back before the
    next, which the layer order saves."""
    micro_batches = 3
    model = Model()
    streamer, _ = streamed(model)
    unit = streamer.layers[0]
    streamer.new_step()
    before_out = streamer.stats.bytes_out
    step(model, batches(0, micro_batches))
    streamer.settle()
    assert streamer.stats.bytes_out - before_out - streamer.resident.grad_nbytes == (
        micro_batches * LAYERS * unit.grad_nbytes
    )


def test_a_forward_without_backward_is_forgotten_and_nothing_else_is_cut() -> None:
    model = CutModel()
    streamer, _, deferred, _ = layer_major(model, 1)
    model(batches(0, 1)[0])  # no backward
    assert deferred.pending
    deferred.clear()
    assert not deferred.pending
    with torch.no_grad():  # under no_grad nothing is cut
        model(batches(0, 1)[0])
    assert not deferred.pending
    plain = Block()  # a checkpoint that runs none of the streamed layers is not cut
    x = torch.randn(2, 16, requires_grad=True)
    out = model.checkpoint(plain, x, use_reentrant=True)
    assert not deferred.pending and out.grad_fn is not None and "Cut" not in type(out.grad_fn).__name__


def test_the_forward_wraps_to_the_next_micro_batch_when_another_follows() -> None:
    schedule = Schedule(3)
    schedule.forward_again = True
    now = schedule.position(2, backward=False)
    assert [schedule.layer_at(now + k) for k in (1, 2)] == [(0, False), (1, False)]
    assert schedule.distance(0, now) == 1 and schedule.distance(2, now) == 3
    schedule.forward_again = False
    assert schedule.layer_at(now + 1) == (2, True)


def test_with_layer_inputs_in_host_memory_each_moves_once_and_the_bits_hold() -> None:
    """Layer inputs offloaded: every micro-batch's inputs wait in host memory until the layer-major backward
    fetches them, one slot per micro-batch ahead; the result is the micro-batch-major run's, bitwise."""
    from megatron_offload.activations.layer_inputs import LayerInputOffloader
    from megatron_offload.core.streams import HostStreams

    micro_batches = 3
    reference, model = Model(), CutModel()
    _, reference_grads, _ = to_flat_buffers(reference)
    streamer, grads, deferred, position = layer_major(model, micro_batches)
    offloader = LayerInputOffloader(HostStreams(), pin=False)

    def note(_module: torch.nn.Module, args: tuple) -> None:  # as the adapter's pre-hook notes layer inputs
        if not torch.is_grad_enabled():
            offloader.note_input(args[0])

    for block in model.blocks:
        block.register_forward_pre_hook(note)
    tokens = batches(0, micro_batches)
    expected = step(reference, tokens)
    streamer.new_step()
    for index, micro_batch in enumerate(tokens):
        position["micro_batch"] = index
        offloader.begin_pass()
        with offloader.hooks():
            loss = model(micro_batch)
        offloader.end_pass()
        loss.backward()
        assert torch.equal(loss, expected[index])
    deferred.run()
    streamer.settle()
    assert torch.equal(grads, reference_grads)
    stats = offloader.read_stats()
    one = 2 * 7 * 16 * 4  # a layer input: batch 2 x 7 tokens x 16 wide, fp32
    assert stats.sent == stats.fetched == micro_batches * (LAYERS - 1)  # each pass's last input stays
    assert stats.bytes_out == stats.bytes_in == micro_batches * (LAYERS - 1) * one
    assert stats.gpu_slot_bytes <= (micro_batches + 1) * one


@pytest.mark.parametrize("weight_slots", [LAYERS + 1, LAYERS, LAYERS - 1])
def test_more_weight_slots_keep_layers_between_micro_batches(weight_slots: int) -> None:
    """With a slot for every layer each comes in once a step, for every forward and backward. With fewer, the
    slot of the layer needed last gives way: slots - 1 layers stay, and the others come in again for each later
    forward and for the backward. Still two fetched ahead; bitwise."""
    micro_batches = 3
    copies = LAYERS + (micro_batches * (LAYERS - weight_slots + 1) if weight_slots < LAYERS else 0)
    reference, model = Model(), CutModel()
    _, reference_grads, _ = to_flat_buffers(reference)
    streamer, grads, deferred, position = layer_major(model, micro_batches, weight_slots)
    assert streamer.depth == 2
    unit = streamer.layers[0]
    for iteration in range(2):
        reference_grads.zero_()
        grads.zero_()
        streamer.new_step()
        before = streamer.stats.bytes_in
        tokens = batches(iteration, micro_batches)
        expected = step(reference, tokens)
        losses = step(model, tokens, deferred, position)
        streamer.settle()
        assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
        assert torch.equal(grads, reference_grads)
        assert (streamer.stats.bytes_in - before - streamer.resident.nbytes) // unit.nbytes == copies
