"""Layer-major backward: every micro-batch's backward of a layer runs while that layer is on the GPU once.

Under full recompute a step of M micro-batches normally runs forward then backward per micro-batch, so a
streamed layer comes to the GPU 2M times and its gradient sum crosses the link 2M - 1 times (out after
each backward, back in before the next). Here the forwards still run micro-batch by micro-batch, as the
framework's loop runs them, but every checkpointed segment's output is cut from the graph behind it: the
loop's backward of a micro-batch reaches only the output layer and the loss, and stops at the last
layer's output, whose gradient it leaves here. Once the loop is done (``run``), the segments' backwards
run layer by layer, last layer first, and within a layer micro-batch by micro-batch:

    for layer L-1 .. 0:  for micro-batch 0 .. M-1:  recompute and backward of (layer, micro-batch)

so each layer comes in once for all its backwards, its gradient sums over the micro-batches in its GPU
slot and leaves once. Each parameter's gradient still adds micro-batch 0, 1, ... in that order, so the
sums are bitwise those of the micro-batch-major loop, as long as no parameter gets gradients both from
the cut segments and from outside them (tied input and output embeddings do: their output layer's part
would move ahead of the embedding's). The caller refuses that case.

A cut is ``_Cut``: an identity whose backward keeps the gradient it receives and passes nothing on. Its
input is the segment's output detached; the segment's output itself is kept as the root of the deferred
backward, its memory given back at once (the cut's output holds the same storage, which whatever moves
layer inputs to host memory frees as before). Knows no Megatron: the caller hands in the checkpoint
function to wrap and how to run a backward from a root whose data was given back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["LayerMajorBackward", "Segment"]


class Streamer(Protocol):
    """What the deferred backward needs of the weight streamer."""

    uses: int  # streamed-layer uses so far: a checkpoint that ran none of ours is not cut
    again: bool  # the layer whose backward runs next is used again right after (another micro-batch)


@dataclass(eq=False)
class Segment:
    """One checkpointed segment of one micro-batch: the root of its backward and the gradient it gets."""

    root: torch.Tensor | None
    grad: torch.Tensor | None = None


class _Cut(torch.autograd.Function):
    """Identity on ``value``; in backward, keeps the gradient in ``segment`` and sends nothing further:
    the segment below runs its backward later, from ``LayerMajorBackward.run``. ``anchor`` (a tiny leaf
    that requires grad) makes the output require grad without a graph behind the value."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor, segment: Segment) -> torch.Tensor:
        ctx.segment = segment
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        segment = ctx.segment
        segment.grad = grad if segment.grad is None else segment.grad + grad
        return None, None, None


class LayerMajorBackward:
    """Cuts the segments that ``checkpoint`` (as wrapped by ``wrap``) runs with streamed layers, and runs
    their backwards layer-major (see the module docstring). ``backward_from(root, grad)`` runs a backward
    from a root whose data was given back (megatron-core's ``custom_backward``)."""

    def __init__(self, streamer: Streamer, backward_from: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        self.streamer = streamer
        self.backward_from = backward_from
        self.enabled = True
        self.micro_batches: list[list[Segment]] = []  # per micro-batch, its segments in forward order
        self._last_output: torch.Tensor | None = None  # the latest cut's output: the next segment's input
        self._anchor: torch.Tensor | None = None
        # One element per device and dtype that every root's data points at once given back: nothing reads or
        # writes a root's data (its backward needs only its graph), so they share it rather than allocate per cut.
        self._placeholders: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def wrap(self, checkpoint: Callable[..., Any], input_at: int = 0) -> Callable[..., Any]:
        """``checkpoint(function, *args, **kwargs)`` as before, its output cut when one of our layers ran
        inside it under grad; ``args[input_at]`` is the segment's input (the hidden states)."""

        def checkpoint_cut(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            uses = self.streamer.uses
            output = checkpoint(function, *args, **kwargs)
            if not self.enabled or self.streamer.uses == uses or not torch.is_grad_enabled():
                return output
            hidden = output[0] if isinstance(output, tuple) else output
            if not isinstance(hidden, torch.Tensor) or hidden.grad_fn is None:
                return output
            cut = self._cut(hidden, args[input_at] if len(args) > input_at else None)
            return (cut, *output[1:]) if isinstance(output, tuple) else cut

        checkpoint_cut.wrapped = checkpoint  # type: ignore[attr-defined]
        checkpoint_cut.cut_by = self  # type: ignore[attr-defined]
        return checkpoint_cut

    def _cut(self, hidden: torch.Tensor, segment_input: Any) -> torch.Tensor:
        if not self.micro_batches or segment_input is not self._last_output:
            self.micro_batches.append([])  # a segment not fed by the last cut: a new micro-batch's first
        if self._anchor is None or self._anchor.device != hidden.device:
            self._anchor = torch.zeros((1,), device=hidden.device, requires_grad=True)
        segment = Segment(hidden)
        value = hidden.detach()  # the same storage: once the root's data is given back, only the cut's output holds it
        if hidden._base is None:  # a view keeps its data: its base holds the storage anyway
            key = (hidden.device, hidden.dtype)
            if key not in self._placeholders:
                self._placeholders[key] = torch.empty((1,), device=hidden.device, dtype=hidden.dtype)
            hidden.data = self._placeholders[key]
        out = _Cut.apply(self._anchor, value, segment)
        self.micro_batches[-1].append(segment)
        self._last_output = out
        return out

    @property
    def pending(self) -> bool:
        return any(self.micro_batches)

    def run(self) -> None:
        """The deferred backwards, layer by layer from the last, micro-batches in order within a layer. A
        micro-batch whose last segment got no gradient (its loss never ran backward) is left out whole."""
        batches, self.micro_batches, self._last_output = self.micro_batches, [], None
        batches = [b for b in batches if b and b[-1].grad is not None]
        depth = max((len(b) for b in batches), default=0)
        try:
            for layer in reversed(range(depth)):
                todo = [b[layer] for b in batches if layer < len(b)]
                for index, segment in enumerate(todo):
                    if segment.grad is None:  # never: the segment above it sent one (else no gradient may go)
                        raise RuntimeError(
                            "megatron-offload: layer-major backward found a segment without the gradient of "
                            "its output after the segment above it ran; its gradients would be lost"
                        )
                    self.streamer.again = index < len(todo) - 1
                    root, grad = segment.root, segment.grad
                    segment.root, segment.grad = None, None  # the graph goes as its backward runs
                    if root.shape == grad.shape:  # a view kept its data
                        torch.autograd.backward(root, grad)
                    else:
                        self.backward_from(root, grad)
        finally:
            self.streamer.again = False
            # A new one each step: a leaf kept across iterations keeps its AccumulateGrad node, which autograd
            # warns about when a later backward runs on another stream.
            self._anchor = None

    def clear(self) -> None:
        """Forget segments whose backward never ran (a forward without backward)."""
        self.micro_batches, self._last_output = [], None
