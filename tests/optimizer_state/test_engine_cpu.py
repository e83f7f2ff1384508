"""The engine's bookkeeping on CPU tensors, the whole state at once: one slab, views, identity, call
order, and state schemas besides torch's Adam (TransformerEngine's mixed dtypes, kept keys, state in a
shared flat buffer).

Copies between two places in host memory prove nothing about streams; the GPU tests do that. What
these prove: every byte comes back where it was, tensors keep their identity, and misuse fails loudly.
Chunks and the streamed step are test_chunks.py's, the plan as the state grows test_plan.py's, failures
test_engine_errors.py's, host room test_host_room.py's.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.optimizer_state.plan import ALIGN
from tests.optimizer_state.cpu_engine import adam_with_masters, aligned, entries, in_host_slab, offloader_for, take_step


def test_one_slab_sized_to_the_state() -> None:
    optimizer, masters = adam_with_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters)
    offloader.offload()
    expected = sum(3 * aligned(m.numel() * 4) for m in masters)  # master + two moments, each aligned
    assert offloader.state.host_slab.nbytes == offloader.stats.host_bytes == offloader.stats.gpu_bytes_freed == expected
    slab_start = offloader.state.host_slab.tensor.data_ptr()
    spans = sorted((e.host.data_ptr() - slab_start, e.nbytes) for e in entries(offloader))
    for (start, size), (next_start, _) in zip(spans, spans[1:], strict=False):
        assert start % ALIGN == 0 and start + size <= next_start  # no two entries share host bytes
    for entry in entries(offloader):
        assert entry.host.untyped_storage().data_ptr() == slab_start  # a view, not a copy


def test_state_round_trips_bit_for_bit_and_keeps_tensor_identity() -> None:
    optimizer, masters = adam_with_masters()
    take_step(optimizer, 0)
    state_objects = {(id(p), key): value for p in masters for key, value in optimizer.state[p].items()}
    before = {key: value.clone() for key, value in state_objects.items()}
    master_before = [m.detach().clone() for m in masters]
    offloader = offloader_for(optimizer, masters)

    offloader.offload()
    assert offloader.is_offloaded
    for param in masters:
        assert in_host_slab(offloader, param)
        assert in_host_slab(offloader, optimizer.state[param]["exp_avg"])
        assert optimizer.state[param]["step"].item() == 1.0  # scalars stay where they are
    offloader.wait()
    for param, expected in zip(masters, master_before, strict=False):
        assert torch.equal(param.detach(), expected)
    for key, value in state_objects.items():
        owner = next(p for p in masters if id(p) == key[0])
        assert optimizer.state[owner][key[1]] is value
        assert torch.equal(value, before[key])


def test_training_with_offload_matches_training_without() -> None:
    torch.manual_seed(0)
    reference, reference_masters = adam_with_masters()
    torch.manual_seed(0)
    offloaded, offloaded_masters = adam_with_masters()
    offloader = offloader_for(offloaded, offloaded_masters)
    for step in range(6):
        take_step(reference, step)
        offloader.wait()
        take_step(offloaded, step)
        offloader.offload()
    offloader.wait()
    for a, b in zip(reference_masters, offloaded_masters, strict=False):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reference.state[a][key], offloaded.state[b][key])


def test_offloaded_state_reads_and_writes_the_host_copy() -> None:
    optimizer, masters = adam_with_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters)
    expected = optimizer.state[masters[1]]["exp_avg"].clone()
    offloader.offload()
    offloader.copies.drain()
    exp_avg = optimizer.state[masters[1]]["exp_avg"]
    assert torch.equal(exp_avg, expected)  # readable while offloaded: a checkpoint save needs no GPU copy
    exp_avg.fill_(7.0)  # a checkpoint load writing while offloaded
    offloader.wait()
    assert torch.equal(optimizer.state[masters[1]]["exp_avg"], torch.full_like(expected, 7.0))
    assert not in_host_slab(offloader, optimizer.state[masters[1]]["exp_avg"])


def test_every_call_order_is_safe() -> None:
    optimizer, masters = adam_with_masters()
    offloader = offloader_for(optimizer, masters)
    offloader.prefetch()  # nothing offloaded yet
    offloader.wait()
    assert offloader.stats.prefetches == 0
    offloader.offload()
    offloader.offload()  # twice
    assert offloader.stats.offloads == 1
    offloader.prefetch()
    offloader.prefetch()  # a copy-in is already under way
    assert offloader.stats.prefetches == 1
    offloader.offload()  # a prefetch followed by a skipped step: straight back out
    offloader.restore()
    assert not offloader.is_offloaded and offloader.state.host_slab is None
    take_step(optimizer, 1)  # the optimizer still works after restore


class TransformerEngineLikeAdam(torch.optim.Optimizer):
    """The state schema of TransformerEngine's FusedAdam with the precision-aware optimizer: bf16
    params, moments in bf16, the fp32 master in ``master_param``, an int ``step``."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": 1e-2})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                if not state:
                    state.update(
                        step=0,
                        master_param=param.float(),
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                    )
                state["step"] += 1
                state["exp_avg"].mul_(0.9).add_(param.grad)
                state["exp_avg_sq"].mul_(0.99).add_(param.grad * param.grad)
                state["master_param"].add_(state["exp_avg"].float(), alpha=-group["lr"])
                param.copy_(state["master_param"])


def test_transformer_engine_state_schema_mixed_dtypes() -> None:
    params = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (64, 3)]
    optimizer = TransformerEngineLikeAdam(params)
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, [])
    expected = {key: optimizer.state[p][key].clone() for p in params for key in ("exp_avg", "master_param")}
    offloader.offload()
    planned = sorted((str(entry.tensor.dtype), entry.nbytes) for entry in entries(offloader))
    moments = [("torch.bfloat16", 2 * n) for n in (64, 3) for _ in ("exp_avg", "exp_avg_sq")]
    assert planned == sorted(moments + [("torch.float32", 4 * n) for n in (64, 3)])
    assert not any(in_host_slab(offloader, param) for param in params)  # params themselves stay
    offloader.wait()
    for key, value in expected.items():
        assert torch.equal(optimizer.state[params[-1]][key], value)


def test_kept_keys_stay_resident() -> None:
    params = [torch.nn.Parameter(torch.randn(8).bfloat16())]
    optimizer = TransformerEngineLikeAdam(params)
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, [], keep_state_keys=["master_param"])
    offloader.offload()
    assert not in_host_slab(offloader, optimizer.state[params[0]]["master_param"])
    assert in_host_slab(offloader, optimizer.state[params[0]]["exp_avg"])


def test_views_into_shared_buffers_are_never_freed(caplog: pytest.LogCaptureFixture) -> None:
    flat = torch.zeros(20)
    with pytest.raises(ValueError, match="view into a larger buffer"):
        OptimizerStateOffloader(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), [flat[:10]])
    param = torch.nn.Parameter(torch.randn(10))
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.state[param]["momentum_buffer"] = flat[10:]  # state living in a shared flat buffer
    offloader = offloader_for(optimizer, [])
    with caplog.at_level(logging.WARNING):
        offloader.offload()
    assert "shares its storage" in caplog.text
    assert flat.untyped_storage().nbytes() == 20 * 4
