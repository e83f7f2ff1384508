"""Layer inputs in host memory: under full recompute, each checkpointed layer's input leaves the GPU after
the layer's forward and comes back ahead of its recompute.

Full recompute keeps one tensor per layer alive from the forward to the backward: the input the layer is
rerun from (``layers x tokens x hidden x 2`` bytes per micro-batch; 12 GiB for 24 x 4096 at 64k tokens).
``LayerInputOffloader`` is a pair of ``torch.autograd.graph.saved_tensors_hooks``: ``pack`` sees the
tensors a checkpoint saves, ``unpack`` hands them back in its backward. Only the layer inputs move (what
the caller named with ``note_input``); everything else a pack sees passes through untouched.

Order of a forward-backward pass of L checkpointed layers:
- forward: the pack of input i sends input i-1 out (one behind, so that the last input of the pass never
  leaves: the backward starts with it); the GPU memory of a sent input goes back to the allocator once
  its copy has read it (``keep_until_copied``), never before;
- backward, in reverse: the unpack of input i waits (on the device) for it unless it has landed, and
  starts bringing input i-1 into the other GPU slot, which the compute stream has finished with: the
  recompute and backward of layer i+1, which used it, were queued before this unpack.
The compute stream waits on events only; the host never waits.

NOTE: a host buffer goes back to the pool at its unpack. The next copy into it is queued after a mark of
the compute stream, which has waited for the copy that read the buffer back: the order is on the device.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from megatron_offload.core.host_memory import HostSlab
from megatron_offload.core.progress import say
from megatron_offload.core.stats import WaitClock
from megatron_offload.core.streams import OFFLOAD, PREFETCH, Event, Streams
from megatron_offload.core.units import GIB

__all__ = ["LayerInputOffloader", "LayerInputStats"]

SLOTS = 2  # the input being recomputed, and the next one arriving (more where every one is held)
MAX_PENDING_WAITS = 256  # timed waits kept for read_stats: a caller that never reads them holds no more


@dataclass
class LayerInputStats:
    """Counters since attach; ``exposed_ms`` counts only waits whose events have completed."""

    sent: int = 0
    fetched: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    exposed_ms: float = 0.0
    host_bytes: int = 0
    host_buffers: int = 0
    gpu_slot_bytes: int = 0


@dataclass(eq=False)
class Saved:
    """One layer input between its pack and its unpack."""

    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    gpu: torch.Tensor | None  # on the GPU: kept (not yet sent, or the pass's last), or its slot once fetched
    previous: Saved | None  # the input packed before this one in the same pass: fetched at this unpack
    host: HostSlab | None = None
    returns: weakref.finalize | None = None  # gives ``host`` back if the pass's backward never runs
    arrived: Event | None = None  # the copy back into ``gpu`` is done
    used: bool = False


@dataclass
class _Slot:
    buffer: torch.Tensor
    holder: Saved | None = None
    free_after: Event | None = None  # compute-stream mark once its last user's kernels were queued


@dataclass
class LayerInputOffloader:
    """Sends noted layer inputs to pinned host memory and fetches them back (see the module docstring)."""

    streams: Streams
    pin: bool = True
    stats: LayerInputStats = field(default_factory=LayerInputStats)

    def __post_init__(self) -> None:
        self._expected: torch.Tensor | None = None
        self._last: Saved | None = None
        self._free_host: dict[int, list[HostSlab]] = defaultdict(list)
        self._slots: list[_Slot] = []
        self._waits = WaitClock(MAX_PENDING_WAITS)
        self._announced = 0  # host bytes already told of in a line (the first pass pins a buffer per layer)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context to run a forward pass in: its checkpoints' saved layer inputs go through us."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def begin_pass(self) -> None:
        self._expected, self._last = None, None

    def note_input(self, tensor: torch.Tensor) -> None:
        """``tensor`` is the input of a layer about to run inside a checkpoint's forward: the next pack of
        this very tensor is a layer input. The first noted since the last pack wins (a checkpoint of
        several layers saves its first layer's input only)."""
        if self._expected is None:
            self._expected = tensor

    def end_pass(self) -> None:
        """The forward pass is over: its last input stays on the GPU (the backward begins with it). A pass
        that made host buffers says so in one line (not one per layer)."""
        self._expected, self._last = None, None
        if self.stats.host_bytes > self._announced:
            say(
                f"megatron-offload: layer inputs hold {self.stats.host_bytes / GIB:.2f} GiB of "
                f"{'pinned' if self.pin else 'pageable'} host memory ({self.stats.host_buffers} buffers), "
                "made once and reused"
            )
            self._announced = self.stats.host_bytes

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | Saved:
        if tensor is not self._expected or not tensor.is_contiguous():
            return tensor
        self._expected = None
        saved = Saved(tensor.shape, tensor.dtype, tensor.numel() * tensor.element_size(), tensor, self._last)
        if self._last is not None:
            self._send(self._last)
        self._last = saved
        return saved

    def unpack(self, saved: torch.Tensor | Saved) -> torch.Tensor:
        if not isinstance(saved, Saved):
            return saved
        if saved.used:
            return saved.gpu
        if saved.host is not None and saved.arrived is None:
            self._fetch(saved)  # not brought ahead (the first input a backward needs after an odd order): now
        if saved.arrived is not None:
            if not saved.arrived.query():  # landed already (a host query, no wait): nothing to order
                self._waits.add(*self.streams.compute_waits(saved.arrived))  # on the device: the input is there
            self.stats.fetched += 1
        mark = self.streams.mark()  # the layers after this one: their recompute and backward are queued
        for slot in self._slots:
            if slot.holder is not None and slot.holder.used:
                slot.holder, slot.free_after = None, mark  # its last reader is behind this mark
        saved.used = True  # after the loop: this input's own slot stays held through its recompute
        self._return_host(saved)
        if saved.previous is not None and saved.previous.host is not None and saved.previous.arrived is None:
            self._fetch(saved.previous)  # into the slot just freed, behind ``mark``
        saved.previous = None
        return saved.gpu

    def read_stats(self) -> LayerInputStats:
        self.stats.exposed_ms = self._waits.read()  # never a host wait: unfinished waits count at a later read
        return LayerInputStats(**vars(self.stats))

    def _send(self, saved: Saved) -> None:
        host = self._host_buffer(saved.nbytes)
        source = saved.gpu.view(-1).view(torch.uint8)
        # After a mark of the compute stream: the input has been written (and earlier reads of this host
        # buffer, waited for by the compute stream, are done).
        self.streams.copy(OFFLOAD, [(host.tensor, source)], self.streams.mark())
        self.streams.keep_until_copied(saved.gpu, OFFLOAD)  # freed below: reused only once the copy read it
        saved.host, saved.gpu = host, None
        saved.returns = weakref.finalize(saved, self._free_host[host.nbytes].append, host)
        self.stats.sent += 1
        self.stats.bytes_out += saved.nbytes

    def _fetch(self, saved: Saved) -> None:
        index = self._slot_for(saved.nbytes)
        slot = self._slots[index]
        slot.holder = saved
        target = slot.buffer[: saved.nbytes]
        # After the mark that freed the slot: the recompute and backward that read it are done first.
        _, saved.arrived = self.streams.copy(PREFETCH, [(target, saved.host.tensor)], slot.free_after)
        saved.gpu = target.view(saved.dtype).view(saved.shape)
        self.stats.bytes_in += saved.nbytes

    def _slot_for(self, nbytes: int) -> int:
        for index, slot in enumerate(self._slots):
            if slot.holder is None and slot.buffer.numel() >= nbytes:
                return index
        free = [index for index, slot in enumerate(self._slots) if slot.holder is None]
        if len(self._slots) < SLOTS or not free:
            # At the first backward; later only where every slot holds an input fetched ahead (a layer-major
            # backward fetches one per micro-batch). Behind a mark: the allocator may hand out memory that
            # kernels queued on the compute stream still use, and the copy into it runs on another stream.
            self._slots.append(_Slot(self.streams.block(nbytes), free_after=self.streams.mark()))
            self.stats.gpu_slot_bytes += nbytes
            return len(self._slots) - 1
        index = free[0]  # a larger input than before (a longer sequence): the slot grows
        self.stats.gpu_slot_bytes += nbytes - self._slots[index].buffer.numel()
        # The old buffer goes back to the compute stream's pool, whose queued work orders its reuse; the new
        # one, as above, is written only behind a mark.
        self._slots[index] = _Slot(self.streams.block(nbytes), free_after=self.streams.mark())
        return index

    def _host_buffer(self, nbytes: int) -> HostSlab:
        free = self._free_host[nbytes]
        if free:
            return free.pop()
        slab = HostSlab(nbytes, torch.uint8, pin=self.pin, label="layer inputs' host memory", announce=False)
        self.stats.host_bytes += nbytes
        self.stats.host_buffers += 1
        return slab

    def _return_host(self, saved: Saved) -> None:
        if saved.host is not None:
            saved.returns.detach()
            self._free_host[saved.host.nbytes].append(saved.host)
            saved.host, saved.returns = None, None
