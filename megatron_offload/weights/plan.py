"""What weight streaming moves: units (a layer's parameters, or everything that stays on the GPU for the
whole iteration), the host memory they live in between uses, and the order layers are used in.

Knows no Megatron: the adapter hands in, per unit, the parameters with their flat host views (weights
and gradients in the same index space, as megatron-core's buffers are) and the unit's place in the
model. Under full activation recompute one layer at a time, a micro-batch uses the L streamed layers
in the order 0, 1, ..., L-1 (forward), then L-1, ..., 0 (recompute and backward): ``Schedule`` turns
that cycle of 2L uses into "which unit comes k uses from now" and "how far away is this unit's next
use", which is all the prefetch and the choice of slot need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Placed", "Run", "Schedule", "Unit", "runs_of"]


@dataclass(eq=False)
class Placed:
    """One parameter of a unit: where it sits in the unit's GPU copy, and its host views, which its
    ``.data`` and gradient attribute point at whenever the unit is not lent to the GPU."""

    param: torch.nn.Parameter
    offset: int  # elements from the start of the unit's GPU copy
    host_data: torch.Tensor
    host_grad: torch.Tensor | None


@dataclass(eq=False)
class Run:
    """A contiguous range of the host buffers that one copy moves: weights and gradients share it."""

    host_weights: torch.Tensor  # flat
    host_grads: torch.Tensor | None  # flat, same length
    start: int  # where it begins in the unit's GPU copy


@dataclass(eq=False)
class Unit:
    """The parameters that come to the GPU together. ``resident``: they stay lent from their first use
    in an iteration until its gradients are settled (the embedding and output layer, whose forward
    saves weights for a backward much later); else a streamed layer, lent around each use."""

    name: str
    index: int  # position among the streamed layers (-1 for the resident unit)
    placed: list[Placed]
    runs: list[Run]
    resident: bool = False
    weights_in: object | None = None  # the Slot holding (or filling with) its weights
    grads_in: object | None = None  # the Slot holding its gradients during its backward
    lent: bool = False  # its params point at GPU memory now
    grads_on_host: bool = False  # the host gradients hold earlier micro-batches of this step
    grads_stale: bool = False  # the host gradients are an earlier step's, not zeroed (the first copy out overwrites)
    summing: bool = False  # its gradient slot holds this step's sum of earlier micro-batches (layer-major)
    weights_dtype: torch.dtype = torch.bfloat16
    grads_dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        return max((run.start + run.host_weights.numel() for run in self.runs), default=0)

    def weight_pairs(self, buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) pairs that bring the weights into ``buffer``."""
        return [(buffer[r.start : r.start + r.host_weights.numel()], r.host_weights) for r in self.runs]

    def grad_pairs(self, buffer: torch.Tensor, to_host: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) pairs for the gradients, to the host or back into ``buffer``."""
        pairs = []
        for run in self.runs:
            if run.host_grads is None:
                continue
            gpu = buffer[run.start : run.start + run.host_grads.numel()]
            pairs.append((run.host_grads, gpu) if to_host else (gpu, run.host_grads))
        return pairs

    def zero_host_grads(self) -> None:
        """Zero the host gradients, as the framework's zeroing would have; they are fresh again."""
        for run in self.runs:
            if run.host_grads is not None:
                run.host_grads.zero_()
        self.grads_stale = False

    @property
    def nbytes(self) -> int:
        return sum(r.host_weights.numel() * r.host_weights.element_size() for r in self.runs)

    @property
    def grad_nbytes(self) -> int:
        return sum(r.host_grads.numel() * r.host_grads.element_size() for r in self.runs if r.host_grads is not None)


def runs_of(spans: Sequence[tuple[int, int]], max_gap: int) -> list[tuple[int, int]]:
    """Merge sorted (start, end) element spans of one buffer into copy ranges, bridging gaps of at most
    ``max_gap`` elements (alignment padding: copying it costs less than another copy)."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start - merged[-1][1] <= max_gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class Schedule:
    """The cycle of uses of ``layers`` streamed layers in one micro-batch under full recompute: positions
    0..L-1 are the forward of layers 0..L-1, positions L..2L-1 the backward of layers L-1..0. With
    ``forward_again`` (layer-major backward, a forward that another micro-batch's forward follows), the
    forward wraps to the next micro-batch's first layer instead of turning into the backward."""

    def __init__(self, layers: int) -> None:
        if layers < 1:
            raise ValueError("weight streaming needs at least one streamed layer")
        self.layers = layers
        self.cycle = 2 * layers
        self.forward_again = False

    def position(self, layer: int, backward: bool) -> int:
        return self.cycle - 1 - layer if backward else layer

    def layer_at(self, position: int) -> tuple[int, bool]:
        """(layer, is_backward) of a position, wrapping into the next micro-batch."""
        if self.forward_again:
            return position % self.layers, False
        position %= self.cycle
        return (self.cycle - 1 - position, True) if position >= self.layers else (position, False)

    def distance(self, layer: int, now: int) -> int:
        """Uses from position ``now`` until ``layer`` is used again (1 = the very next use)."""
        if self.forward_again:
            return (layer - now - 1) % self.layers + 1
        uses = (self.position(layer, False), self.position(layer, True))
        return min((use - now - 1) % self.cycle + 1 for use in uses)
