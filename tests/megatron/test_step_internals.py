"""The streamed step's reaches into megatron-core, on CPU tensors against megatron-core's own functions
(their ``device='cuda'`` scalars and the one-rank all-reduce stood in for): the norm made from per-tensor
norms is the float ``get_grad_norm_fp32`` returns, and clipping deferred into chunks, each staged to
memory of its own before Adam, gives the bits of megatron-core's clipping over all params, then Adam."""

from __future__ import annotations

import pytest
import torch

clip_grads = pytest.importorskip("megatron.core.optimizer.clip_grads", reason="needs megatron-core installed")

from megatron_offload.megatron.step_internals import ClipDeferral, local_norm_kernels, norm_of_norms  # noqa: E402
from megatron_offload.optimizer_state.chunk_step import ChunkStepper  # noqa: E402
from megatron_offload.optimizer_state.staged_params import StagedParams  # noqa: E402


@pytest.fixture
def cuda_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's scalars made on the CPU, its all-reduce over one rank, its CUDA type check passed."""
    for name in ("tensor", "zeros"):
        original = getattr(torch, name)

        def on_cpu(*args, original=original, **kwargs):
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, name, on_cpu)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)
    real_type = torch.Tensor.type
    monkeypatch.setattr(
        torch.Tensor,
        "type",
        lambda self, *a, **k: "torch.cuda.FloatTensor" if not a and not k else real_type(self, *a, **k),
    )


def gradients(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(37,), (64, 33), (5, 7, 11), (1,), (4096,), (129, 17)]
    return [torch.randn(shape, generator=generator) * scale for shape in shapes]


def test_megatron_core_here_uses_torch_norm_kernels() -> None:
    assert local_norm_kernels(), "apex or TransformerEngine is installed: the slot norms are not used"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_norm_of_per_tensor_norms_is_megatron_cores_norm(cuda_on_cpu, seed: int, scale: float) -> None:
    grads = [g.view(-1) for g in gradients(seed, scale)]
    expected = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=None)
    # the same tensors copied elsewhere (as into a GPU slot), normed one by one
    slot = torch.zeros(sum(g.numel() + 64 for g in grads))
    views, offset = [], 0
    for grad in grads:
        views.append(slot[offset : offset + grad.numel()].copy_(grad))
        offset += -(-(grad.numel()) // 16) * 16 + 64
    got = norm_of_norms([torch.norm(view) for view in views], group=None)
    assert isinstance(got, float) and got == expected


def masters_and_adam(seed: int, grad_scale: float) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(seed + 100)
    params = []
    for grad in gradients(seed, grad_scale):
        param = torch.nn.Parameter(torch.randn(grad.shape, generator=generator), requires_grad=False)
        param.grad = grad
        params.append(param)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return params, optimizer


@pytest.mark.parametrize("grad_scale", [1e-4, 10.0])  # clip coefficient above 1 (no clipping), and below
def test_clipping_deferred_into_staged_chunks_matches_megatron_core(cuda_on_cpu, grad_scale: float) -> None:
    expected, reference = masters_and_adam(0, grad_scale)
    params, optimizer = masters_and_adam(0, grad_scale)
    for step in range(3):
        for ref, ours in zip(expected, params, strict=True):
            ref.grad, ours.grad = (g * (step + 1) for g in (ref.grad, ref.grad))
        total = clip_grads.get_grad_norm_fp32([p.grad for p in expected], grad_stats_parallel_group=None)
        clip_grads.clip_grad_by_total_norm_fp32(expected, 1.0, total)  # megatron-core: all at once, in place
        reference.step()

        host_grads = [p.grad.clone() for p in params]
        stage, deferral = StagedParams(), ClipDeferral(clip_grads.clip_grad_by_total_norm_fp32)
        deferral.register(params, stage)
        deferral(params, 1.0, total)  # where megatron-core's step calls it: deferred
        assert stage.clips and all(torch.equal(p.grad, g) for p, g in zip(params, host_grads, strict=True))
        stepper = ChunkStepper(optimizer)
        for chunk in (params[:2], params[2:3], params[3:]):
            homes = [p.data for p in chunk]
            stage.lend(chunk)
            assert all(p.data.data_ptr() != home.data_ptr() for p, home in zip(chunk, homes, strict=True))
            stepper(chunk, key=tuple(id(p) for p in chunk))
            stage.give_back()
            assert all(p.data.data_ptr() == home.data_ptr() for p, home in zip(chunk, homes, strict=True))
        stage.end_step()
        for ref, ours in zip(expected, params, strict=True):
            assert torch.equal(ref.data, ours.data), f"step {step}: a master differs"
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(reference.state[ref][key], optimizer.state[ours][key])
        # the host gradients keep their unclipped values: the update read the clipped copies
        assert all(torch.equal(p.grad, g) for p, g in zip(params, host_grads, strict=True))


def test_a_call_over_params_of_no_stage_runs_megatron_cores_clipping(cuda_on_cpu) -> None:
    params, _ = masters_and_adam(3, 10.0)
    before = [p.grad.clone() for p in params]
    deferral = ClipDeferral(clip_grads.clip_grad_by_total_norm_fp32)
    deferral.register(params[:2], StagedParams())
    deferral(params, 1.0, 1000.0)  # mixed: not deferred
    assert all(torch.allclose(p.grad, g * (1.0 / (1000.0 + 1e-6))) for p, g in zip(params, before, strict=True))
