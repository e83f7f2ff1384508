"""The output layer's cross-entropy loss without the [tokens, vocab] logits.

``chunked_linear_cross_entropy`` gives what megatron-core's ``compute_language_model_loss(labels, hidden @
weight.T)`` gives (per-token fp32 cross entropy, [b, s]) but walks the tokens in chunks, so only one chunk's
logits exist at a time.

Saves: the [tokens, vocab] fp32 logits and their gradient, 8 x vocab bytes per token (17 GB at 64k tokens and
a 32,000 vocabulary; more counting the logits in the input dtype), never exist; one chunk's do (about 256 MiB of
fp32 logits per buffer with ``default_chunk_tokens``). Kept for backward: the hidden states and weight (which
autograd keeps for the output layer anyway), the labels, and one fp32 log-sum-exp per token (4 bytes).

Costs: backward recomputes each chunk's logits, one extra [tokens, h] x [h, vocab] GEMM, a third more than
the output layer's usual three GEMMs; and a python loop of tokens / chunk_tokens steps.

Why not liger-kernel's fused linear cross entropy: with mean or sum reduction it computes the gradients in
the forward and keeps grad_hidden [tokens, h] and a weight-sized grad_weight (fp32 when ``accum_dtype`` asks)
alive until the backward, a pair per micro-batch in flight under pipeline parallelism. Megatron-core wants the
per-token loss (``reduction='none'``, masked afterwards): older liger scales the already summed grad_weight by
it, which is wrong, and recent liger (checked at commit 00eba63) recomputes in backward as here. And it needs
liger's Triton kernels; this file is torch only, runs on a CPU, and gives the same bits on every call.

NOTE: the whole vocabulary on one rank (no tensor-parallel vocab split), no label smoothing, no ignore index
(megatron-core masks the per-token loss afterwards); labels are not range-checked (that needs a host sync).
"""

from __future__ import annotations

import torch

__all__ = ["chunked_linear_cross_entropy", "default_chunk_tokens"]

_CHUNK_LOGITS_BYTES = 256 * 2**20  # one chunk's fp32 logits
_MIN_CHUNK, _MAX_CHUNK = 256, 8192
# torch >= 2.8 has a GEMM that reads bf16/fp16 and writes fp32 (CUDA only: CPU has no kernel for it).
_HAS_FP32_OUT_GEMM = hasattr(torch.ops.aten.addmm, "dtype_out")


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk so one chunk's fp32 logits take about 256 MiB: a power of two in [256, 8192]."""
    if vocab < 1:
        raise ValueError(f"vocab must be at least 1, got {vocab}")
    tokens = max(1, _CHUNK_LOGITS_BYTES // (4 * vocab))
    return min(_MAX_CHUNK, max(_MIN_CHUNK, 1 << (tokens.bit_length() - 1)))  # round down to a power of two


def _accumulate_grad_weight(acc: torch.Tensor, g: torch.Tensor, hidden_c: torch.Tensor) -> None:
    """acc [V, h] fp32 += g.T @ hidden_c, without a weight-sized temporary where the hardware allows."""
    if g.dtype == torch.float32:
        acc.addmm_(g.t(), hidden_c)  # fp32 inputs: accumulate in place
    elif _HAS_FP32_OUT_GEMM and g.is_cuda:
        # The GEMM's fp32 result lands in the accumulator directly: neither a bf16 rounding of each chunk's
        # product nor a [V, h] temporary per chunk. This is the accumulating form of torch.mm(..., out_dtype=
        # torch.float32) (which would still need a temporary); liger-kernel makes the same call.
        torch.addmm(acc, g.t(), hidden_c, out_dtype=torch.float32, out=acc)
    else:
        # CPU, or torch < 2.8: the product in the input dtype (one rounding per chunk, the GEMM itself sums in
        # fp32), then added into the fp32 accumulator so the rounding does not grow with the number of chunks.
        acc += torch.mm(g.t(), hidden_c)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: per chunk, logits in the input dtype, upcast, log-sum-exp. Backward: recompute them."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        s, b, h = hidden.shape
        hidden_2d = hidden.reshape(s * b, h)  # row i = token (i // b, i % b): sequence-first order
        labels_1d = labels.t().reshape(-1).long()  # [b, s] -> the same order as hidden_2d's rows
        tokens = s * b
        loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            logits = (hidden_2d[start:end] @ weight.t()).float()
            torch.logsumexp(logits, dim=-1, out=lse[start:end])
            target = logits.gather(1, labels_1d[start:end, None]).squeeze(1)
            torch.sub(lse[start:end], target, out=loss[start:end])
            del logits, target  # the next chunk's logits reuse this memory
        ctx.save_for_backward(hidden_2d, weight, labels_1d, lse)
        ctx.chunk, ctx.shape = chunk, (s, b, h)
        return loss.view(s, b).t().contiguous()  # [b, s], as megatron-core returns it

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_2d, weight, labels_1d, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_1d = grad_loss.t().reshape(-1).float()  # [b, s] -> token order of hidden_2d
        grad_hidden = torch.empty_like(hidden_2d) if want_hidden else None
        acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden_2d.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden_2d.shape[0])
            hidden_c, label_c = hidden_2d[start:end], labels_1d[start:end, None]
            # d loss / d logits = softmax - onehot(label), formed in place in the recomputed fp32 logits.
            p = (hidden_c @ weight.t()).float().sub_(lse[start:end, None]).exp_()
            p.scatter_(1, label_c, p.gather(1, label_c) - 1.0)  # one index per row: no accumulation, no atomics
            g = p.mul_(grad_1d[start:end, None]).to(hidden_2d.dtype)
            del p
            if want_hidden:
                torch.mm(g, weight, out=grad_hidden[start:end])
            if want_weight:
                _accumulate_grad_weight(acc, g, hidden_c)
            del g
        grad_hidden = grad_hidden.view(ctx.shape) if want_hidden else None
        grad_weight = acc.to(weight.dtype) if want_weight else None
        return grad_hidden, grad_weight, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Per-token cross entropy [b, s] fp32 of ``logits = hidden @ weight.T`` without materialising the logits.

    hidden: [s, b, h] (megatron-core's sequence-first layout), bf16 or fp32. weight: [V, h], the output
    layer's weight, same dtype. labels: [b, s] integer (batch-first, as megatron-core passes them).
    chunk_tokens: rows of the flattened [s * b, h] hidden per chunk; default ``default_chunk_tokens(V)``.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [s, b, h], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must be [vocab, {hidden.shape[2]}] for hidden {tuple(hidden.shape)}, got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight and hidden must share a dtype, got {weight.dtype} and {hidden.dtype}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    s, b = hidden.shape[0], hidden.shape[1]
    if tuple(labels.shape) != (b, s):
        raise ValueError(
            f"labels must be [b, s] = [{b}, {s}] for hidden {tuple(hidden.shape)}, got {tuple(labels.shape)}"
        )
    chunk = default_chunk_tokens(weight.shape[0]) if chunk_tokens is None else chunk_tokens
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk)
