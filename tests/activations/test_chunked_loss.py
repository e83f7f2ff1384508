"""The chunked output-layer loss against the plain one: values, gradients, bits, and the memory it never takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_offload.activations.chunked_loss import chunked_linear_cross_entropy, default_chunk_tokens

S, H, V = 24, 16, 96  # h < chunk so a weight-sized tensor stays below the token-times-vocab bound


def _inputs(b: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, b, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(dtype) * 3  # logits of a few units: a peaked softmax
    labels = torch.randint(0, V, (b, S), generator=gen)
    mask = (torch.rand(b, S, generator=gen) > 0.3).float()
    return hidden, weight, labels, mask / mask.sum()  # upstream gradient: loss mask times 1 / num_tokens


def _reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """megatron-core's unfused path: the whole [s, b, V] logits, labels turned to [s, b], loss back to [b, s]."""
    s, b, _ = hidden.shape
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits.view(-1, V), labels.t().reshape(-1), reduction="none").view(s, b).t()


def _loss_and_grads(fn, hidden, weight, labels, upstream, **kw) -> tuple[torch.Tensor, ...]:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(hidden, weight, labels, **kw)
    (loss * upstream).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("chunk", [1, 8, 7, 100], ids=["one", "divides", "does-not-divide", "exceeds"])
def test_loss_and_gradients_match_the_plain_reference_in_fp32(b: int, chunk: int) -> None:
    hidden, weight, labels, upstream = _inputs(b)
    got = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, labels, upstream, chunk_tokens=chunk)
    want = _loss_and_grads(_reference, hidden, weight, labels, upstream)
    assert got[0].shape == (b, S) and got[0].dtype == torch.float32
    for name, g, w in zip(("loss", "grad_hidden", "grad_weight"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_token_order_by_hand() -> None:
    """One token worked out alone, so a transposed reference could not hide a transposed implementation."""
    hidden, weight, labels, _ = _inputs(b=2)
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    i_b, i_s = 1, 17
    logits = hidden[i_s, i_b] @ weight.t()
    assert loss[i_b, i_s].item() == pytest.approx((logits.logsumexp(0) - logits[labels[i_b, i_s]]).item(), abs=1e-5)


def test_bf16_is_close_to_the_fp32_reference() -> None:
    hidden, weight, labels, upstream = _inputs(b=2, dtype=torch.bfloat16)
    got = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, labels, upstream, chunk_tokens=7)
    want = _loss_and_grads(_reference, hidden.float(), weight.float(), labels, upstream)  # same values, exact math
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    # Loss: the only rounding is each bf16 logit z (relative 2**-9), and loss = lse(z) - z[label] moves by at
    # most twice the largest logit error, so |error| <= 2 * max|z| * 2**-9 = max|z| / 256.
    max_logit = (hidden.float().reshape(-1, H) @ weight.float().t()).abs().max().item()
    assert (got[0] - want[0]).abs().max().item() <= max_logit / 256
    # Gradients: bf16 logits (above), softmax - onehot rounded to bf16 (2**-9), the GEMM output rounded to bf16
    # (2**-9) and, for grad_weight, each chunk's product (2**-9): a few 2**-8 = 0.4% each. 2% leaves headroom
    # for their sum while a wrong gradient (a dropped upstream scale, a token misplaced) is off by O(1).
    for g, w in zip(got[1:], want[1:], strict=True):
        assert ((g.float() - w).norm() / w.norm()).item() < 2e-2


def test_bf16_weight_gradient_accumulates_in_fp32_across_chunks() -> None:
    # 256 chunks of same-sign contributions to grad_weight: a bf16 running sum loses each increment's bits below
    # 2**-8 of the sum (measured: 8.5% off). With the fp32 accumulator what remains is the bf16 rounding of the
    # logits, of softmax - onehot, of each chunk's product and of the result, 2**-9 relative each: under 1% even
    # if all four lined up (measured: 0.1%).
    gen = torch.Generator().manual_seed(2)
    s, b, h, v = 256, 2, 4, 8
    hidden = (1 + 0.1 * torch.rand(s, b, h, generator=gen)).bfloat16()
    weight = (0.1 * torch.randn(v, h, generator=gen)).bfloat16().requires_grad_()
    labels, upstream = torch.zeros(b, s, dtype=torch.long), torch.full((b, s), 1 / (b * s))
    (chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=2) * upstream).sum().backward()
    ref_weight = weight.detach().float().requires_grad_()
    logits = hidden.float().reshape(-1, h) @ ref_weight.t()
    (F.cross_entropy(logits, labels.t().reshape(-1), reduction="none") / (b * s)).sum().backward()
    assert ((weight.grad.float() - ref_weight.grad).norm() / ref_weight.grad.norm()).item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_calls_give_identical_bits(dtype: torch.dtype) -> None:
    hidden, weight, labels, upstream = _inputs(b=2, dtype=dtype)
    first = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, labels, upstream, chunk_tokens=7)
    second = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, labels, upstream, chunk_tokens=7)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)


def test_loss_does_not_depend_on_chunk_tokens() -> None:
    # Random fp32 inputs: close, not bitwise. MKL's sgemm picks its kernel and blocking by the number of rows,
    # so the same token's dot products can be summed in another order (measured: ~1e-6 apart for 5 vs 64 rows).
    hidden, weight, labels, _ = _inputs(b=2)
    torch.testing.assert_close(
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=5),
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=64),
        rtol=0,
        atol=1e-5,
    )
    # Small-integer inputs make every logit exact whatever the summation order: then everything after the GEMM
    # is per token, and the losses must agree to the bit for any chunking.
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randint(-3, 4, (S, 2, H), generator=gen).float()
    weight = torch.randint(-2, 3, (V, H), generator=gen).float() / 4
    losses = [chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=c) for c in (1, 5, 16, 48)]
    assert all(torch.equal(losses[0], other) for other in losses[1:])


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op creates, and how many GEMMs ran."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.gemms = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        self.gemms += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
        return out


@pytest.mark.parametrize("fn", [chunked_linear_cross_entropy, _reference], ids=["chunked", "reference"])
def test_no_tokens_by_vocab_tensor_is_ever_alive(fn) -> None:
    hidden, weight, labels, upstream = _inputs(b=2)
    hidden.requires_grad_()
    weight.requires_grad_()
    chunk, tokens = 16, S * 2
    kwargs = {"chunk_tokens": chunk} if fn is chunked_linear_cross_entropy else {}
    with _Largest() as probe:
        loss = fn(hidden, weight, labels, **kwargs)
        (loss * upstream).sum().backward()
    if fn is _reference:  # the probe sees the whole logits when they are there
        assert probe.numel >= tokens * V
    else:  # one chunk's logits, or the [V, h] fp32 grad_weight accumulator
        assert probe.numel <= max(chunk * V, V * H) < tokens * V


def test_backward_skips_the_gradient_nobody_asked_for() -> None:
    hidden, weight, labels, upstream = _inputs(b=2)
    chunks = -(-S * 2 // 7)
    gemms = {}
    for wants in ("both", "weight", "hidden"):
        h = hidden.clone().requires_grad_(wants in ("both", "hidden"))
        w = weight.clone().requires_grad_(wants in ("both", "weight"))
        loss = chunked_linear_cross_entropy(h, w, labels, chunk_tokens=7)
        with _Largest() as probe:
            (loss * upstream).sum().backward()
        gemms[wants] = probe.gemms
        assert (h.grad is None) == (wants == "weight") and (w.grad is None) == (wants == "hidden")
    # per chunk: the logits recompute, then grad_hidden and/or grad_weight
    assert gemms == {"both": 3 * chunks, "weight": 2 * chunks, "hidden": 2 * chunks}


def test_default_chunk_tokens() -> None:
    assert default_chunk_tokens(32_000) == 2048 and default_chunk_tokens(128_256) == 512
    assert default_chunk_tokens(1000) == 8192 and default_chunk_tokens(2**22) == 256  # clamped
    for vocab in (32_000, 50_257, 128_256, 151_936):
        chunk = default_chunk_tokens(vocab)
        assert chunk & (chunk - 1) == 0 and 128 * 2**20 < chunk * vocab * 4 <= 256 * 2**20


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h, w, lab: (h[0], w, lab, None), r"hidden must be \[s, b, h\], got shape \(2, 16\)"),
        (lambda h, w, lab: (h, w[:, :8], lab, None), r"weight must be \[vocab, 16\].*got \(96, 8\)"),
        (lambda h, w, lab: (h, w[0], lab, None), r"weight must be \[vocab, 16\].*got \(16,\)"),
        (lambda h, w, lab: (h, w.double(), lab, None), r"share a dtype, got torch.float64 and torch.float32"),
        (lambda h, w, lab: (h, w, lab.float(), None), r"labels must be an integer tensor, got torch.float32"),
        (lambda h, w, lab: (h, w, lab.t(), None), r"labels must be \[b, s\] = \[2, 24\].*got \(24, 2\)"),
        (lambda h, w, lab: (h, w, lab, 0), r"chunk_tokens must be at least 1, got 0"),
        (lambda h, w, lab: (h, w, lab, -3), r"chunk_tokens must be at least 1, got -3"),
    ],
    ids=["hidden-2d", "weight-width", "weight-1d", "dtype", "float-labels", "labels-s-b", "chunk-0", "chunk-neg"],
)
def test_bad_inputs_are_refused_naming_what_was_given(change, message: str) -> None:
    hidden, weight, labels, _ = _inputs(b=2)
    with pytest.raises(ValueError, match=message):
        chunked_linear_cross_entropy(*change(hidden, weight, labels))


def test_default_chunk_tokens_refuses_an_empty_vocab() -> None:
    with pytest.raises(ValueError, match="vocab must be at least 1, got 0"):
        default_chunk_tokens(0)
