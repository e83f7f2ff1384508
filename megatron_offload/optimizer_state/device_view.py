"""The state's tensors as the code around the offloader meets them on the device, apart from the copies
(chunk_copies.py): every gradient checked against the GPU the step runs on, device stand-ins for offloaded
params while code assigns their gradients before the step, and at detach each tensor in storage of its own.
The one owner of the stand-ins; it reads the chunks from the plan (planned_state.py) as it stands at each call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_offload.optimizer_state.planned_state import PlannedState

__all__ = ["DeviceView"]


class DeviceView:
    """What the optimizer's step, and the code that prepares it, see of the offloader's tensors on ``device``."""

    def __init__(self, device: torch.device | None, state: PlannedState) -> None:
        self.device = device
        self.state = state  # the offloader's; a new plan brings new chunks, so they are read at each call
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}  # one scalar per dtype, expanded to each shape

    def check_gradients(self) -> None:
        """Refuse a gradient on another device than the GPU the step runs on, before anything moves:
        while offloaded, a param's ``.data`` is its host copy, so a gradient made from it lands on the
        CPU, and Adam would fail half-way with a device error."""
        if self.device is None or self.device.type != "cuda":
            return
        for chunk in self.state.chunks:
            for param in chunk.params:
                grad = param.grad
                if grad is not None and grad.device != self.device:
                    raise ValueError(
                        f"megatron-offload: a parameter's gradient is on {grad.device} but its optimizer step "
                        f"runs on {self.device} (shape {tuple(param.shape)}): while offloaded, a param's .data "
                        "is its host copy; make gradients on the GPU (e.g. torch.randn(shape, device='cuda'))"
                    )

    @contextlib.contextmanager
    def params_on_device(self) -> Iterator[None]:
        """While inside, offloaded params (master weights) look like device tensors of the right shape
        (no memory behind them), so code that assigns their ``.grad`` before the step works."""
        swapped = []
        if self.device is not None and self.device.type == "cuda":
            for chunk in self.state.chunks:
                for entry in chunk.entries:
                    if not chunk.on_gpu and entry.is_param:
                        dtype = entry.tensor.dtype
                        if dtype not in self._placeholders:
                            self._placeholders[dtype] = torch.empty((), dtype=dtype, device=self.device)
                        entry.tensor.data = self._placeholders[dtype].expand(entry.tensor.shape)
                        swapped.append((chunk, entry))
        try:
            yield
        finally:
            for chunk, entry in swapped:
                if not chunk.on_gpu:
                    entry.tensor.data = entry.host

    def own_storage(self) -> None:
        """Each tensor of a chunk in a block in storage of its own again, and the block let go (at detach,
        with the whole state back on the device)."""
        for chunk in self.state.chunks:
            if chunk.block is not None:  # one chunk at a time, so this costs one chunk of extra memory
                for entry in chunk.entries:
                    entry.tensor.data = entry.tensor.data.clone()
                chunk.block = None
