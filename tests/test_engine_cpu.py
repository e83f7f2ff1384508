"""The engine's bookkeeping on CPU tensors: slabs, views, identity, ordering and error paths.

Copies between two places in host memory prove nothing about streams; the GPU tests do that. What
these prove: every byte comes back where it was, tensors keep their identity, and misuse fails loudly.
"""

import logging

import pytest
import torch

from megatron_offload import HostMemoryError, OptimizerStateOffloader, host_memory


def adam_with_masters(sizes: tuple[int, ...] = (37, 1000, 5)) -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    """fp32 masters that are the optimizer's params, like DistributedOptimizer's inner Adam."""
    masters = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    return torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1), masters


def take_step(optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
    optimizer.step()


def offloader_for(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], **kwargs) -> OptimizerStateOffloader:
    return OptimizerStateOffloader(optimizer, masters, pin_memory=False, check_host_memory=False, **kwargs)


def in_host_slab(offloader: OptimizerStateOffloader, tensor: torch.Tensor) -> bool:
    """True when ``tensor`` now holds its host copy (on CPU the device and host are both memory, so
    where the data lives is the only difference there is)."""
    slab_pointers = {slab.tensor.untyped_storage().data_ptr() for slab in offloader._slabs}
    return tensor.untyped_storage().data_ptr() in slab_pointers


def test_one_slab_per_dtype_sized_to_the_state() -> None:
    optimizer, masters = adam_with_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters)
    offloader.offload()
    numel = sum(m.numel() for m in masters)
    assert [slab.tensor.numel() for slab in offloader._slabs] == [3 * numel]  # master + two moments
    assert offloader.stats.host_bytes == offloader.stats.gpu_bytes_freed == 3 * numel * 4
    slab_start = offloader._slabs[0].tensor.data_ptr()
    starts = sorted(entry.host.data_ptr() - slab_start for entry in offloader._entries)
    assert starts == sorted({*starts})  # no two entries share host bytes
    for entry in offloader._entries:
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
    offloader.host_copies_ready()
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
    assert not offloader.is_offloaded and offloader._slabs == []
    take_step(optimizer, 1)  # the optimizer still works after restore


def test_moments_created_at_the_first_step_join_the_plan() -> None:
    optimizer, masters = adam_with_masters()
    offloader = offloader_for(optimizer, masters)
    offloader.offload()  # before the first step: only the masters exist
    masters_only = offloader.stats.host_bytes
    assert masters_only == sum(m.numel() for m in masters) * 4
    offloader.wait()
    take_step(optimizer, 0)
    offloader.offload()
    assert offloader.stats.host_bytes == 3 * masters_only
    assert in_host_slab(offloader, optimizer.state[masters[0]]["exp_avg_sq"])


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
    sizes = {slab.tensor.dtype: slab.tensor.numel() for slab in offloader._slabs}
    assert sizes == {torch.bfloat16: 2 * 67, torch.float32: 67}
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


def test_host_room_check_names_the_way_out() -> None:
    gib = 1024**3
    host_memory.check_host_room(4 * gib, ranks=2, available=16 * gib)
    with pytest.raises(HostMemoryError) as error:
        host_memory.check_host_room(12 * gib, ranks=2, available=16 * gib)
    message = str(error.value)
    assert "12.00 GiB" in message and "2 rank(s)" in message and "24.00 GiB" in message
    assert "--no-offload-master-weights" in message and "--no-offload-host-memory-check" in message


def test_offloader_checks_host_room_before_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer, masters = adam_with_masters()
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1000)
    with pytest.raises(HostMemoryError):
        OptimizerStateOffloader(optimizer, masters, pin_memory=False)
    # masters (4 B) + two Adam moments (8 B) per element, estimated before the moments exist
    offloader = OptimizerStateOffloader(optimizer, masters, pin_memory=False, check_host_memory=False)
    assert offloader.estimated_host_bytes() == 12 * sum(m.numel() for m in masters)


def test_available_host_bytes_reads_this_machine() -> None:
    assert 0 < host_memory.available_host_bytes() < 1 << 50
