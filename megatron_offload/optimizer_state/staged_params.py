"""A chunk's params and gradients brought to the GPU for its update, when they live in device-mapped
host memory (weight streaming builds the fp32 masters and gradients there).

Kernels can update such params where they are, but each pass of the update then crosses the link
(Adam reads a gradient twice and writes a param twice; clipping reads and writes every gradient;
the master-to-model copy reads the param again). Here each chunk's params and gradients cross once
each way: copied into GPU memory before the update (4 bytes each per fp32 element in), the update
and the deferred clipping run there, and the params go back after it (4 bytes out); the gradients
are not written back (nothing reads them before the next step zeroes or overwrites them).

Knows no optimizer and no Megatron. The copies are ordinary copy kernels on the compute stream, in
order with the update around them: no event, no wait, and the host never waits.
NOTE: after a deferred clipping, the host gradients keep their unclipped values (the update used the
clipped GPU copies); a reader of the gradients after the step would see the difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["StagedParams"]

Clip = Callable[[Sequence[torch.Tensor]], None]


class StagedParams:
    """The stage of a streamed step (``streamed_step.run(..., stage=...)``): ``lend`` before a chunk's
    update, ``give_back`` after it (and after the master-to-model copy, which reads the GPU copies)."""

    def __init__(self) -> None:
        self.clips: list[Clip] = []  # the clippings deferred to the chunks of this step, in megatron's order
        self.bytes_in = 0  # bytes copied to the GPU (params and gradients), since attach
        self.bytes_out = 0  # bytes copied back (params)
        self._lent: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def defer_clip(self, clip: Clip) -> None:
        """Apply ``clip(params)`` to each chunk's gradients before its update, this step (after those deferred
        before it); ``clip`` leaves alone the params it was not meant for."""
        self.clips.append(clip)

    @torch.no_grad()
    def lend(self, params: list[torch.Tensor], copy: bool = True) -> None:
        """Before an update of ``params``: with ``copy``, point each param and its gradient at GPU copies;
        then apply the deferred clipping to the gradients the update will read."""
        if copy:
            for param in params:
                host_data, host_grad = param.data, param.grad
                param.data = host_data.clone()  # over the link once; ordered on the compute stream
                self.bytes_in += host_data.numel() * host_data.element_size()
                if host_grad is not None:
                    param.grad = host_grad.clone()  # the clipping and the update read this copy
                    self.bytes_in += host_grad.numel() * host_grad.element_size()
                self._lent.append((param, host_data, host_grad))
        for clip in self.clips:
            clip(params)

    @torch.no_grad()
    def give_back(self) -> None:
        """After the update: the params' new values back into their host memory; params and gradients point
        there again (the GPU copies are freed in stream order: only the compute stream used them)."""
        for param, host_data, host_grad in self._lent:
            host_data.copy_(param.data)
            self.bytes_out += host_data.numel() * host_data.element_size()
            param.data = host_data
            param.grad = host_grad
        self._lent = []

    def end_step(self) -> None:
        """The step is over (or skipped): its clipping is not applied again."""
        self.clips = []
