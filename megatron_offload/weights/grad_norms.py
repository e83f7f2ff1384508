"""Per-tensor gradient norms taken on the GPU, while a unit's gradients sit in their slot after the last
backward of a step: the optimizer's norm and the NaN check then need not read the host gradients.

Knows no Megatron: a watch names a host gradient view by its address and length (the tensor the
optimizer's norm will be asked about) and where the same elements sit in the unit's slot.

NOTE: a norm taken from the slot has the bits of the same norm over the host view only when both
views hold the same elements, contiguous, in the same dtype, at the same alignment (the reduction
kernel's vectorized loads depend on it): ``watch`` refuses other placements (their norms are then
missing, and the caller reads the host gradients as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ALIGN_BYTES", "SlotNorms", "grad_key"]

# Both views must sit at the same address modulo this: more than any vectorized load of a reduction
# kernel (16 or 32 bytes on CUDA); megatron-core starts each param 64 elements apart.
ALIGN_BYTES = 64

Key = tuple[int, int]


def grad_key(grad: torch.Tensor) -> Key:
    """How a gradient tensor is known: its address and length (views of the same elements match)."""
    return grad.data_ptr(), grad.numel()


@dataclass(eq=False)
class SlotNorms:
    """The norms of the watched gradient views, taken at most once per step (``clear`` starts one)."""

    watches: dict[int, list[tuple[Key, int, int]]] = field(default_factory=dict)
    """Per unit index: (host key, offset in the unit's slot, elements)."""
    taken: dict[Key, torch.Tensor] = field(default_factory=dict)
    """This step's norms (0-dim device tensors), by host key."""

    def watch(self, unit_index: int, host_grad: torch.Tensor, offset: int) -> None:
        """Take ``host_grad``'s norm from the unit's slot at ``offset`` (a contiguous view only)."""
        if host_grad.is_contiguous():
            self.watches.setdefault(unit_index, []).append((grad_key(host_grad), offset, host_grad.numel()))

    def take(self, unit_index: int, slot: torch.Tensor) -> None:
        """The unit's gradients are final in ``slot`` (flat): queue their norms on the current stream, which
        must be the one the copy out of the slot is ordered after. A view at another alignment than its
        host view is left out (its norm could differ in the last bit)."""
        size = slot.element_size()
        for key, offset, numel in self.watches.get(unit_index, ()):
            if (slot.data_ptr() + offset * size - key[0]) % ALIGN_BYTES == 0:
                # torch.norm, as megatron-core's norm without apex or TransformerEngine takes each tensor's.
                self.taken[key] = torch.norm(slot[offset : offset + numel])

    def clear(self) -> None:
        """A new step: nothing taken yet."""
        self.taken = {}

    def norms_of(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """This step's norms of ``grads``, in their order; None if any was not taken from a slot."""
        found = [self.taken.get(grad_key(grad)) for grad in grads]
        return None if any(norm is None for norm in found) else found
