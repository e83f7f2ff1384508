"""A chunk's params and gradients brought to the GPU for its update, when they live in device-mapped
host memory (weight streaming builds the fp32 masters and gradients there).

Kernels can update such params where they are, but each pass of the update then crosses the link
(Adam reads a gradient twice and writes a param twice; clipping reads and writes every gradient;
the master-to-model copy reads the param again). Here each group's params and gradients cross once
each way: copied into a GPU buffer before the update (4 bytes each per fp32 element in), the update
and the deferred clipping run there, and the params go back after it (4 bytes out); the gradients
are not written back (nothing reads them before the next step zeroes or overwrites them).

The copies run on the copy core's side streams (core/streams.py) through ``STAGED_BUFFERS`` buffers
taken once per step: group i+1 comes in while group i is updated and group i-1 goes out, both
directions of the link at once. The compute stream waits for a copy in on the device only; a buffer
is refilled only after its copy out has read it; the host never waits. The update's kernels are the
same as with the params in GPU memory anywhere: only where the copies run differs.
Knows no optimizer and no Megatron.
NOTE: after a deferred clipping, the host gradients keep their unclipped values (the update used the
clipped GPU copies); a reader of the gradients after the step would see the difference.
NOTE: the step ends with the compute stream ordered after the last copy out: whatever reads the host
masters next (the next step, a checkpoint) sees them whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_offload.core.streams import OFFLOAD, PREFETCH, Event, HostStreams, Streams

__all__ = ["ALIGN", "STAGED_BUFFERS", "StagedParams", "staged_bytes"]

Clip = Callable[[Sequence[torch.Tensor]], None]
STAGED_BUFFERS = 3  # one group coming in, one updated, one going out
ALIGN = 256  # bytes: where each tensor starts inside a buffer (as in the state's chunks)
GRAD_ELEMENT_BYTES = 4  # the widest gradient counted for a param not staged yet (megatron's fp32 main_grad)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def staged_bytes(params: Sequence[torch.Tensor], grads_known: bool = True) -> int:
    """GPU bytes a group of ``params`` takes in a buffer: each param, and its gradient (with
    ``grads_known`` False, one of ``GRAD_ELEMENT_BYTES`` per element, as before the backward made it)."""
    total = 0
    for param in params:
        total += _aligned(_nbytes(param))
        if not grads_known:
            total += _aligned(param.numel() * max(GRAD_ELEMENT_BYTES, param.element_size()))
        elif param.grad is not None:
            total += _aligned(_nbytes(param.grad))
    return total


@dataclass(eq=False)
class _Buffer:
    memory: torch.Tensor  # flat bytes, from the compute stream's pool
    params: list[torch.Tensor] | None = None  # the group it holds or is being filled with
    homes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=list
    )  # per param: (param, host data, host gradient, data in the buffer, gradient in the buffer)
    ready: Event | None = None  # its copy in: the compute stream waits for it before the update
    read_out: Event | None = None  # its copy out: nothing may refill it before that has read it


class StagedParams:
    """The stage of a streamed step (``streamed_step.run(..., stage=...)``): ``begin`` with the groups
    in update order, ``lend`` before a group's update, ``give_back`` after it (and after the
    master-to-model copy, which reads the GPU copies), ``end_step`` once the step is over."""

    def __init__(self, streams: Streams | None = None) -> None:
        self.streams = streams or HostStreams()
        self.clips: list[Clip] = []  # the clippings deferred to the chunks of this step, in megatron's order
        self.bytes_in = 0  # bytes copied to the GPU (params and gradients), since attach
        self.bytes_out = 0  # bytes copied back (params)
        self.buffer_bytes = 0  # GPU bytes of this step's buffers (0 between steps)
        self._order: list[list[torch.Tensor]] = []  # this step's groups, in update order
        self._next = 0  # the position in ``_order`` of the group lent next
        self._buffers: list[_Buffer] = []
        self._lent: _Buffer | None = None
        self._fresh: Event | None = None  # compute mark at begin: the buffers' memory and host gradients free
        self._last_out: Event | None = None  # the latest copy out queued (the side stream runs in order)

    def defer_clip(self, clip: Clip) -> None:
        """Apply ``clip(params)`` to each chunk's gradients before its update, this step (after those deferred
        before it); ``clip`` leaves alone the params it was not meant for."""
        self.clips.append(clip)

    def begin(self, order: Sequence[Sequence[torch.Tensor]]) -> None:
        """A step will update these groups in this order: take the buffers, start the first copy in."""
        self._release()
        self._order, self._next = [list(group) for group in order], 0
        if not self._order:
            return
        size = max(staged_bytes(group) for group in self._order)
        self._buffers = [_Buffer(self.streams.block(size)) for _ in range(min(STAGED_BUFFERS, len(self._order)))]
        self.buffer_bytes = size * len(self._buffers)
        # Pool memory compute work still queued may have used, and host gradients written before this mark.
        self._fresh = self.streams.mark()
        self._bring_in(0)

    @torch.no_grad()
    def lend(self, params: list[torch.Tensor], copy: bool = True) -> None:
        """Before an update of ``params``: with ``copy``, point each param and its gradient at their copies
        in a buffer (prefetched when ``params`` is the next group of ``begin``'s order); then apply the
        deferred clipping to the gradients the update will read."""
        if copy:
            buffer = self._filled(params)
            if buffer.ready is not None and not buffer.ready.query():
                self.streams.wait(buffer.ready)  # on the device: the copy in lands before the update reads it
            buffer.ready = None
            for param, _, host_grad, data, grad in buffer.homes:
                param.data = data
                if host_grad is not None:
                    param.grad = grad  # the clipping and the update read this copy
            self._lent = buffer
            self._bring_in(self._next)  # the next group comes in while this one is updated
        for clip in self.clips:
            clip(params)

    @torch.no_grad()
    def give_back(self) -> None:
        """After the update: the params' new values go back to host memory on the copy-out stream, and the
        params and gradients point there again."""
        buffer, self._lent = self._lent, None
        if buffer is None:
            return
        pairs = [(host_data, data) for _, host_data, _, data, _ in buffer.homes]
        # After a compute mark: the update and the master-to-model copy have written and read the buffer.
        _, buffer.read_out = self.streams.copy(OFFLOAD, pairs, self.streams.mark())
        self._last_out = buffer.read_out
        self.bytes_out += sum(_nbytes(host_data) for host_data, _ in pairs)
        for param, host_data, host_grad, _, _ in buffer.homes:
            param.data = host_data
            param.grad = host_grad
        buffer.params = None

    def end_step(self) -> None:
        """The step is over (or skipped): its clipping is not applied again; the compute stream is ordered
        after the last copy out, and the buffers go back to the pool."""
        self.clips = []
        if self._lent is not None:
            self.give_back()  # a step cut short: the params point at their host copies again
        if self._last_out is not None and not self._last_out.query():
            self.streams.wait(self._last_out)  # on the device: later readers of the host masters see them
        self._last_out = None
        self._release()

    def _release(self) -> None:
        for buffer in self._buffers:
            # Freed now; the allocator reuses the memory only once the copies queued on both side streams,
            # which may still read or fill it, are done (no host wait).
            self.streams.keep_until_copied(buffer.memory, OFFLOAD)
            self.streams.keep_until_copied(buffer.memory, PREFETCH)
        self._buffers, self._order, self._next, self._fresh, self.buffer_bytes = [], [], 0, None, 0

    def _filled(self, params: list[torch.Tensor]) -> _Buffer:
        """The buffer holding ``params`` (or coming in): the next group's, else one filled now."""
        if self._next < len(self._order) and _same(self._order[self._next], params):
            buffer = self._buffers[self._next % len(self._buffers)]
            if buffer is not self._lent and (buffer.params is None or _same(buffer.params, params)):
                self._next += 1
                if buffer.params is None:  # its copy in was not started yet
                    self._fill(buffer, params)
                return buffer
        # Not the group expected (or no ``begin``): the order is dropped, this group is staged on its own.
        self._release()
        if self._last_out is not None and not self._last_out.query():
            self.streams.wait(self._last_out)  # on the device: a host copy it reads may still be written
        self._buffers = [_Buffer(self.streams.block(staged_bytes(params)))]
        self._fresh = self.streams.mark()  # as in ``begin``
        buffer = self._buffers[0]
        self._fill(buffer, params)
        return buffer

    def _bring_in(self, position: int) -> None:
        if position >= len(self._order):
            return
        buffer = self._buffers[position % len(self._buffers)]
        if buffer is self._lent or buffer.params is not None:
            return  # still in use by a group not given back: filled at its own ``lend``
        self._fill(buffer, self._order[position])

    def _fill(self, buffer: _Buffer, params: list[torch.Tensor]) -> None:
        memory, offset, homes, pairs = buffer.memory, 0, [], []
        for param in params:
            host_data, host_grad = param.data, param.grad
            data = memory[offset : offset + _nbytes(host_data)].view(host_data.dtype).view(host_data.shape)
            offset += _aligned(_nbytes(host_data))
            pairs.append((data, host_data))
            grad = None
            if host_grad is not None:
                grad = memory[offset : offset + _nbytes(host_grad)].view(host_grad.dtype).view(host_grad.shape)
                offset += _aligned(_nbytes(host_grad))
                pairs.append((grad, host_grad))
            homes.append((param, host_data, host_grad, data, grad))
        # After the buffer's last copy out has read it (which itself followed its update), else after the
        # step's first mark: the memory is free and the host gradients are whole.
        after = buffer.read_out if buffer.read_out is not None else self._fresh
        _, buffer.ready = self.streams.copy(PREFETCH, pairs, after)
        buffer.params, buffer.homes, buffer.read_out = params, homes, None
        self.bytes_in += sum(_nbytes(source) for _, source in pairs)


def _same(expected: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    return len(expected) == len(params) and all(a is b for a, b in zip(expected, params, strict=True))
