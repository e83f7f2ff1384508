"""The engine's bookkeeping on CPU tensors: slabs, views, identity, ordering and error paths.

Copies between two places in host memory prove nothing about streams; the GPU tests do that. What
these prove: every byte comes back where it was, tensors keep their identity, and misuse fails loudly.
"""

import logging

import pytest
import torch

from megatron_offload import HostMemoryError, OffloadCopyError, OptimizerStateOffloader
from megatron_offload.core import host_memory
from megatron_offload.core.streams import HostStreams
from megatron_offload.optimizer_state import plan, streamed_step
from megatron_offload.optimizer_state.chunk_step import ChunkStepper, RestrictedStep
from megatron_offload.optimizer_state.plan import ALIGN


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


def run_step(offloader: OptimizerStateOffloader, after_chunk=None) -> None:
    """The streamed step, with one stepper per offloader (its lists are made once per plan), then the
    copies it queued have landed, as they have once the training loop's next points have passed."""
    stepper = offloader.__dict__.setdefault("_test_stepper", ChunkStepper(offloader.optimizer))
    try:
        streamed_step.run(offloader, stepper, after_chunk)
    finally:
        offloader.copies.drain()


def in_host_slab(offloader: OptimizerStateOffloader, tensor: torch.Tensor) -> bool:
    """True when ``tensor`` now holds its host copy (on CPU the device and host are both memory, so
    where the data lives is the only difference there is)."""
    return tensor.untyped_storage().data_ptr() == offloader.state.host_slab.tensor.untyped_storage().data_ptr()


def entries(offloader: OptimizerStateOffloader) -> list:
    return [entry for chunk in offloader.chunks for entry in chunk.entries]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


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


def test_moments_created_at_the_first_step_join_the_plan() -> None:
    optimizer, masters = adam_with_masters()
    offloader = offloader_for(optimizer, masters)
    offloader.offload()  # before the first step: only the masters exist
    masters_only = offloader.stats.host_bytes
    assert masters_only == sum(aligned(m.numel() * 4) for m in masters)
    slab = offloader.state.host_slab
    assert slab.nbytes == 3 * masters_only  # sized for the moments to come: pinned once
    offloader.wait()
    take_step(optimizer, 0)
    offloader.offload()
    assert offloader.stats.host_bytes == 3 * masters_only
    assert offloader.state.host_slab is slab
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


# ------------------------------------------------------------------------ chunks and the streamed step
def many_masters() -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    torch.manual_seed(0)
    return adam_with_masters((37, 1000, 5, 300, 64, 700, 1))


def set_grads(optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)


def assert_same_training_state(reference: torch.optim.Optimizer, actual: torch.optim.Optimizer) -> None:
    for a, b in zip(reference.param_groups[0]["params"], actual.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(reference.state[a][key], actual.state[b][key]), key


@pytest.mark.parametrize("prefetch_bytes", [None, 0, 6000])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_streamed_step_matches_the_plain_step_bit_for_bit(prefetch_bytes: int | None, fraction: float) -> None:
    reference, _ = many_masters()
    offloaded, masters = many_masters()
    offloader = offloader_for(offloaded, masters, chunk_bytes=2000, fraction=fraction)
    offloader.offload()
    for step in range(5):
        set_grads(reference, step)
        reference.step()
        set_grads(offloaded, step)
        offloader.prefetch(max_bytes=prefetch_bytes)
        with offloader.device_view.params_on_device():
            run_step(offloader)
        assert offloader.is_offloaded
        assert all((not chunk.on_gpu) is not chunk.kept for chunk in offloader.chunks)  # kept ones stay
    assert len(offloader.chunks) > (3 if fraction == 1.0 else 1)
    if prefetch_bytes == 0:
        assert offloader.stats.bytes_streamed >= 4 * offloader.stats.offloaded_bytes  # steps 2-5 streamed it all
    offloader.wait()
    assert_same_training_state(reference, offloaded)


def test_chunks_hold_whole_parameters_and_respect_the_size() -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    owner_of = {id(p): p for p in masters} | {id(v): p for p in masters for v in optimizer.state[p].values()}
    owners = {}
    for index, chunk in enumerate(offloader.chunks):
        largest_param = max(aligned(p.numel() * 4) for p in chunk.params)
        assert chunk.nbytes < 2000 + 3 * largest_param  # closes at the first param boundary past the size
        for entry in chunk.entries:
            owners.setdefault(id(owner_of[id(entry.tensor)]), set()).add(index)
    assert all(len(chunks) == 1 for chunks in owners.values())  # a param's master and moments share a chunk


def test_fraction_keeps_the_rest_on_the_device() -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, fraction=0.5)
    offloader.offload()
    total = offloader.stats.host_bytes  # every byte is planned, so that kept state can leave at once
    assert 0.3 * total < offloader.stats.offloaded_bytes < 0.7 * total
    assert offloader.stats.kept_bytes == total - offloader.stats.offloaded_bytes
    kept = [p for chunk in offloader.chunks if chunk.kept for p in chunk.params]
    assert kept and all(not in_host_slab(offloader, p) for p in kept)
    none = offloader_for(*many_masters(), fraction=0.0)
    none.offload()
    assert none.stats.offloaded_bytes == 0 and not none.is_offloaded


def test_a_new_fraction_moves_whole_chunks_and_keeps_values() -> None:
    reference, _ = many_masters()
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    for step, fraction in enumerate([1.0, 0.25, 0.25, 0.75, 0.0, 1.0]):
        offloader.set_fraction(fraction)
        set_grads(reference, step)
        reference.step()
        set_grads(optimizer, step)
        with offloader.device_view.params_on_device():
            run_step(offloader)
        kept = [chunk for chunk in offloader.chunks if chunk.kept]
        assert all(chunk.on_gpu for chunk in kept)  # newly kept chunks came back through the step
        assert all((not chunk.on_gpu) for chunk in offloader.chunks if not chunk.kept)
        share = offloader.stats.offloaded_bytes / offloader.stats.host_bytes
        assert abs(share - fraction) < 0.25, (fraction, share)
        assert offloader.kept_bytes == offloader.plan.kept_bytes()  # the hooks read this count, kept current
    offloader.wait()
    assert_same_training_state(reference, optimizer)


def test_eviction_offloads_kept_chunks_with_their_values() -> None:
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000, fraction=0.0)
    take_step(optimizer, 0)
    offloader.offload()
    before = {id(p): (p.clone(), optimizer.state[p]["exp_avg"].clone()) for p in masters}
    assert offloader.stats.kept_bytes == offloader.stats.host_bytes and not offloader.is_offloaded
    started = offloader.evict(1)
    assert 0 < started < offloader.stats.host_bytes  # the first kept chunk, not all of them
    offloader.copies.drain()
    evicted = [chunk for chunk in offloader.chunks if (not chunk.on_gpu)]
    assert len(evicted) == 1 and not evicted[0].kept
    assert offloader.stats.kept_bytes == offloader.stats.host_bytes - evicted[0].nbytes
    assert offloader.kept_bytes == offloader.plan.kept_bytes()
    offloader.wait()
    for p in masters:
        assert torch.equal(p, before[id(p)][0]) and torch.equal(optimizer.state[p]["exp_avg"], before[id(p)][1])


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


def test_a_chunk_that_came_back_unused_is_dropped_not_copied() -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    copied = offloader.stats.bytes_offloaded
    offloader.prefetch()  # brought back during backward, then the step is skipped (inf/nan grads)
    offloader.offload()
    assert offloader.stats.bytes_offloaded == copied and offloader.is_offloaded


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


class GroupCountingAdam(torch.optim.Optimizer):
    """Counts steps per param group, as apex's and TransformerEngine's FusedAdam do."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for param in group["params"]:
                param.add_(param.grad, alpha=-group["lr"] / group["step"])


def test_restricted_step_counts_one_step_however_many_chunks() -> None:
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    optimizer = GroupCountingAdam(params)
    for param in params:
        param.grad = torch.ones(4)
    stepper = RestrictedStep(optimizer)
    for param in params:
        stepper([param])
    assert optimizer.param_groups[0]["step"] == 1
    assert len(optimizer.param_groups[0]["params"]) == 3
    assert all(torch.equal(p, torch.full((4,), 0.9)) for p in params)


def test_bad_chunk_size_and_fraction_name_the_parameter() -> None:
    optimizer, masters = adam_with_masters()
    with pytest.raises(ValueError, match="^OptimizerStateOffloader: chunk_bytes must be positive, got 0$"):
        offloader_for(optimizer, masters, chunk_bytes=0)
    with pytest.raises(ValueError, match="^OptimizerStateOffloader: fraction must be from 0 to 1, got 1.5$"):
        offloader_for(optimizer, masters, fraction=1.5)


def test_adam_first_moments_join_their_chunks_without_a_new_plan() -> None:
    optimizer, masters = many_masters()
    for master in masters:
        master.requires_grad_(False)  # as Megatron's masters: Adam steps them, their grads set by hand
    offloader = offloader_for(optimizer, masters, chunk_bytes=6000)
    offloader.offload()  # at attach: only the masters exist
    chunks, slab = list(offloader.chunks), offloader.state.host_slab
    set_grads(optimizer, 0)
    run_step(offloader)  # Adam's first step creates the moments chunk by chunk
    assert offloader.chunks == chunks and offloader.state.host_slab is slab  # same plan, same pinned slab
    assert all(in_host_slab(offloader, optimizer.state[p][key]) for p in masters for key in ("exp_avg", "exp_avg_sq"))
    assert offloader.stats.host_bytes == sum(3 * aligned(m.numel() * 4) for m in masters)
    assert all(len(chunk.entries) == 3 * len(chunk.params) for chunk in chunks)


@pytest.mark.parametrize("offloaded_masters", [slice(0, 3), slice(0, 0)])
def test_params_without_an_offloaded_master_get_their_moments_planned(offloaded_masters: slice) -> None:
    # Megatron's fp32 params (and every param under --no-offload-master-weights) are optimizer params
    # whose own tensor stays put; only the moments their first step creates leave.
    optimizer, masters = many_masters()
    offloader = offloader_for(optimizer, masters[offloaded_masters], chunk_bytes=6000)
    offloader.offload()
    chunks = list(offloader.chunks)
    set_grads(optimizer, 0)
    run_step(offloader)
    assert offloader.chunks == chunks  # no new plan, so nothing came back whole
    assert all(in_host_slab(offloader, optimizer.state[p]["exp_avg_sq"]) for p in masters)
    assert [in_host_slab(offloader, p) for p in masters] == [i in range(7)[offloaded_masters] for i in range(7)]
    assert offloader.stats.offloads == (2 if offloaded_masters.stop else 1)


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


def test_the_offload_right_after_a_whole_streamed_step_needs_no_second_walk_over_the_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    optimizer, masters = many_masters()
    take_step(optimizer, 0)
    offloader = offloader_for(optimizer, masters, chunk_bytes=2000)
    offloader.offload()
    walks = []
    walk = plan.offloadable_tensors
    monkeypatch.setattr(plan, "offloadable_tensors", lambda *args: walks.append(args) or walk(*args))

    def step(after_chunk=None) -> None:
        set_grads(optimizer, len(walks))
        streamed_step.run(offloader, ChunkStepper(optimizer), after_chunk)

    step()
    assert len(walks) == 1  # the step's own check
    offloader.offload(now=False)
    assert len(walks) == 1  # the step vouched for the plan
    offloader.offload(now=False)
    assert len(walks) == 2  # for one call only
    step()
    step()
    assert len(walks) == 4  # each step checks for itself, vouched for or not
    offloader.state.replaced()  # a checkpoint load in between
    offloader.offload(now=False)
    assert len(walks) == 6  # the check, then the new plan

    def fail(params: list[torch.Tensor]) -> None:
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        step(fail)
    offloader.offload(now=False)
    assert len(walks) == 8  # a step that failed half-way vouches for nothing
