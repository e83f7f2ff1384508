"""The streamer's part in the step as one pass, without a GPU: per-tensor gradient norms taken in the
slots after the last micro-batch equal the norms of the host gradients bitwise, and a step whose
gradient zeroing was skipped ends with the same host gradients as one that zeroed them."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.core.streams import HostStreams
from megatron_offload.weights.grad_norms import SlotNorms, grad_key
from megatron_offload.weights.streamer import WeightStreamer
from tests.weights.test_streamer import Model, batches, to_flat_buffers, unit_of

ALIGN = 16  # elements: params start 64 bytes apart, as megatron-core starts them 64 elements apart


def streamed(model: Model, last_microbatch=lambda: True) -> tuple[WeightStreamer, torch.Tensor, SlotNorms]:
    weights, grads, spans = to_flat_buffers(model, align=ALIGN)
    layers = [
        unit_of(f"block{i}", i, list(b.parameters()), weights, grads, spans, max_gap=ALIGN)
        for i, b in enumerate(model.blocks)
    ]
    rest = list(model.embedding.parameters()) + list(model.head.parameters())
    resident = unit_of("resident", -1, rest, weights, grads, spans, resident=True, max_gap=ALIGN)
    norms = SlotNorms()
    for unit in [*layers, resident]:
        for placed in unit.placed:
            norms.watch(unit.index, placed.host_grad, placed.offset)
    streamer = WeightStreamer(layers, resident, HostStreams(), norms=norms, last_microbatch=last_microbatch)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(
            lambda m, args, i=i: streamer.before_forward(i, torch.is_grad_enabled(), args[0])
        )
        block.register_forward_hook(lambda m, args, out, i=i: streamer.after_forward(i, torch.is_grad_enabled()))
    model.embedding.register_forward_pre_hook(lambda *_: streamer.lend_resident())
    return streamer, grads, norms


def run_step(model: Model, streamer: WeightStreamer, step: int, micro_batches: int, last: list[bool]) -> None:
    streamer.new_step()
    for index, tokens in enumerate(batches(step, micro_batches)):
        last[0] = index == micro_batches - 1  # megatron-core's DDP: no_sync() for all but the last
        model(tokens).backward()
    streamer.settle()


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_slot_norms_equal_the_host_gradients_norms_bitwise(micro_batches: int) -> None:
    last = [True]
    model = Model()
    streamer, _, norms = streamed(model, lambda: last[0])
    for step in range(2):
        run_step(model, streamer, step, micro_batches, last)
        host = [p.main_grad.view(-1) for p in model.parameters()]
        taken = norms.norms_of(host)
        assert taken is not None, "a norm was not taken in a slot"
        for grad, norm in zip(host, taken, strict=True):
            assert torch.equal(norm, torch.norm(grad)), "a slot's norm differs from the host gradient's"


def test_norms_are_taken_after_the_last_micro_batch_only() -> None:
    last = [False]
    model = Model()
    streamer, _, norms = streamed(model, lambda: last[0])
    streamer.new_step()
    for tokens in batches(0, 2):  # last[0] stays False: the layers' norms are not this step's final ones
        model(tokens).backward()
    streamer.settle()
    block = next(iter(model.blocks[0].parameters()))
    assert norms.norms_of([block.main_grad]) is None
    head = model.head.weight  # the resident unit's gradients leave once, at settle: final by then
    assert norms.norms_of([head.main_grad]) is not None
    streamer.new_step()
    assert norms.taken == {}


def test_a_misaligned_slot_view_gives_no_norm() -> None:
    norms = SlotNorms()
    host = torch.zeros(64)[16:32]
    norms.watch(0, host, offset=1)  # one element off the host view's alignment
    norms.take(0, torch.ones(64))
    assert norms.norms_of([host]) is None
    norms.watch(1, host, offset=16)
    norms.take(1, torch.ones(64))
    assert torch.equal(norms.norms_of([host])[0], torch.tensor(4.0)) and grad_key(host) in norms.taken


def fill_runs(streamer: WeightStreamer, value: float) -> None:
    """Every host gradient range a unit copies (padding between units is never written by anyone)."""
    for unit in [*streamer.layers, streamer.resident]:
        for run in unit.runs:
            run.host_grads.fill_(value)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_skipping_the_zeroing_leaves_the_same_gradients(micro_batches: int) -> None:
    """Host gradients full of the last step's values (zeroing skipped) end the step as zeroed ones would."""
    last = [True]
    reference, model = Model(), Model()
    ref_streamer, ref_grads, _ = streamed(reference, lambda: last[0])
    streamer, grads, _ = streamed(model, lambda: last[0])
    for step in range(3):
        ref_streamer.new_step()
        ref_grads.zero_()  # megatron-core's zeroing
        streamer.new_step()
        streamer.skip_zeroing()  # not zeroed: the last step's gradients stay until overwritten
        if step == 0:
            fill_runs(streamer, float("nan"))
        for index, tokens in enumerate(batches(step, micro_batches)):
            last[0] = index == micro_batches - 1
            reference(tokens).backward()
            model(tokens).backward()
        ref_streamer.settle()
        streamer.settle()
        assert torch.equal(grads, ref_grads)


def test_a_unit_without_backward_is_zeroed_at_settle() -> None:
    model = Model()
    streamer, grads, _ = streamed(model)
    fill_runs(streamer, 3.0)
    streamer.new_step()
    streamer.skip_zeroing()
    with torch.no_grad():  # a forward only: no gradient leaves any slot
        model(batches(0, 1)[0])
    streamer.settle()
    assert torch.count_nonzero(grads) == 0
