"""Sleep and wake: hand the GPU memory of a training job to someone else between training phases.

RL post-training runs an inference engine on the trainer's GPUs between updates. ``Sleeper.sleep()``
moves what the caller names (optimizer state through the engine's offloaders; flat device buffers,
such as gradient and parameter buffers, whole) into pinned host memory, frees the device storage and
returns it to the device (``torch.cuda.empty_cache()``), so ``torch.cuda.mem_get_info`` shows it free
to other processes. ``wake()`` brings it all back, bitwise, into the same tensor objects.

The parts, and the host memory that ``prepare()`` at setup (or else the first sleep) pins for them,
are parts.py's (``SleepParts``, which a ``Sleeper`` holds as ``held``); what each call returns or raises is
report.py's.

The parts of a sleep or wake go over the link one after another, never beside each other: the
buffers' copies through the copy core (core/copies.py: one ``Copy`` per part, on one side stream,
started all at once), then the engine's copies, which it orders after the compute stream's queued
work, so making the compute stream wait for the buffers' copies puts the state's behind them. Each
part's time is read from CUDA events, and a wake allocates the next part's device memory while the
link carries the previous part.

This module knows nothing of Megatron: parts are optimizer offloaders and lists of tensors whose whole
storage is parked. Of the engine it uses ``offload()``, ``copies.drain()``, ``wait()``, ``restore()``
and ``offloaded_bytes``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from megatron_offload.core.copies import CopyQueue
from megatron_offload.core.streams import Event, streams_for
from megatron_offload.core.units import GIB
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader
from megatron_offload.sleep.parked_buffers import DEFAULT_CHUNK_BYTES, ParkedBuffers, Transfer
from megatron_offload.sleep.parts import OPTIMIZER, SleepParts
from megatron_offload.sleep.report import SleepError, SleepReport, device_memory

__all__ = ["DEFAULT_CHUNK_BYTES", "ParkedBuffers", "Sleeper", "Transfer"]

logger = logging.getLogger(__name__)


class Sleeper:
    """Sleep and wake for a set of named parts (``held``: parts.py); one sleep at a time, each refused before
    anything moves. With ``state_lives_on_host`` (an attached handle offloads the state between steps) a wake
    leaves the state on the host, where the next step expects it; otherwise a wake brings it back. ``busy()``
    returns why a sleep must wait (mid-step), or None. ``device`` is taken from the buffers when omitted."""

    def __init__(
        self,
        offloaders: Sequence[OptimizerStateOffloader],
        buffers: dict[str, Sequence[torch.Tensor]],
        *,
        state_lives_on_host: bool = False,
        busy: Callable[[], str | None] = lambda: None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pin_memory: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self.held = SleepParts(
            offloaders, buffers, state_lives_on_host=state_lives_on_host, chunk_bytes=chunk_bytes, pin_memory=pin_memory
        )
        self.busy = busy
        self.asleep: tuple[str, ...] = ()  # the parts the current sleep moved; empty while awake
        self.last_report: SleepReport | None = None
        if device is None:
            tensors = [t for part in self.buffers.values() for t in part.tensors]
            device = tensors[0].device if tensors else None
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._copies: CopyQueue | None = None  # made at the first sleep: its side stream, on CUDA

    @property
    def offloaders(self) -> list[OptimizerStateOffloader]:
        return self.held.offloaders

    @property
    def buffers(self) -> dict[str, ParkedBuffers]:
        return self.held.buffers

    @property
    def is_asleep(self) -> bool:
        return bool(self.asleep)

    def prepare(self, parts: Sequence[str] = (OPTIMIZER,)) -> SleepReport:
        """Pin the host memory a sleep of ``parts`` needs, now, at setup (``SleepParts.prepare``)."""
        return self.held.prepare(parts)

    def host_bytes_needed(self, parts: Sequence[str]) -> int:
        return self.held.host_bytes_needed(parts)

    # ---------------------------------------------------------------------------------- copies
    @property
    def _on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    @property
    def copies(self) -> CopyQueue:
        """The buffers' copies, on a side stream beside the compute stream current at the first use."""
        if self._copies is None:
            self._copies = CopyQueue(streams_for(self.device if self._on_cuda else None))
        return self._copies

    # ------------------------------------------------------------------------------------ sleep
    def _check(self, parts: tuple[str, ...]) -> None:
        if self.asleep:
            raise SleepError(f"already asleep ({', '.join(self.asleep)}): call wake() before sleeping again")
        for name in parts:
            part = self.buffers.get(name)
            if part is not None and not part.intact():
                raise SleepError(
                    f"cannot sleep {name}: a buffer was freed or resized by someone else since (megatron-core's "
                    "offload_grad_buffers?): bring it back first"
                )
        reason = self.busy()
        if reason:
            raise SleepError(f"cannot sleep {reason}: call sleep() between training steps")
        self.held.check_host_room(parts, "sleep")

    def sleep(self, parts: Sequence[str] = (OPTIMIZER,)) -> SleepReport:
        """Move ``parts`` to pinned host memory and give their device memory back to the device."""
        names = self.held.names(parts, "sleep")
        self._check(names)
        if self._on_cuda:
            # Cached blocks freed earlier (activations) would otherwise count as what this sleep gave back.
            torch.cuda.empty_cache()
        free, allocated, _ = device_memory()
        report = SleepReport("sleep", device_free_before=free, allocated_before=allocated)
        start = time.perf_counter()
        report.pinned = [self.held.pin(name) for name in names if not self.held.pinned(name)]
        if report.pinned:
            logger.warning(
                "megatron-offload: the first sleep pinned %.2f GiB of host memory on the way (%.1f s): call "
                "prepare() at setup so that the first sleep runs at the link's speed",
                sum(t.nbytes for t in report.pinned) / GIB,
                sum(t.seconds for t in report.pinned),
            )
        buffers = [self.buffers[name] for name in names if name in self.buffers]
        queue = self.copies
        streams = queue.streams
        # The copies read what kernels queued on the compute stream write (a sleep right after a step):
        # each part's copy starts at once, its side stream waiting on the device for that work.
        after = streams.mark()
        timed: list[tuple[Transfer, Event, Event]] = []  # (part, its copies started, they landed)
        link: Event | None = None  # the latest copy's end: the link is free after it
        for part in buffers:
            copy = queue.put(part.copy_out(after), now=True)
            timed.append((Transfer(part.name, part.nbytes, 0.0), copy.began, copy.done))
            link = copy.done
        if link is not None:
            # The engine orders its copies after the compute stream's queued work: this puts them behind
            # the buffers' on the link (one part at a time, each timed on its own), and keeps compute work
            # from writing a buffer before its copy has read it.
            streams.wait(link)
        if OPTIMIZER in names:
            began = link or streams.mark(timed=True)
            moved = self._offload_state()  # returns once the state's copies have landed
            landed = streams.mark(timed=True)  # nothing else is queued on the compute stream: reached at once
            timed.append((Transfer(OPTIMIZER, moved, 0.0), began, landed))
        # On the host: a buffer's device memory is freed next, so its copies must have landed.
        queue.drain()
        for part in buffers:
            part.free()
        if self._on_cuda:
            # What we freed sits in PyTorch's cache, still taken as far as the device is concerned.
            torch.cuda.empty_cache()
        report.seconds = time.perf_counter() - start
        report.transfers = self._timed(timed)
        report.device_free_after, report.allocated_after, report.reserved_after = device_memory()
        self.asleep, self.last_report = names, report
        return report

    def _timed(self, timed: list[tuple[Transfer, Event, Event]]) -> list[Transfer]:
        """Each part with its time on the link, once the last mark was reached (elapsed times need it)."""
        if timed:
            timed[-1][2].synchronize()  # after every other: the state's, or the buffers' last copy
        for transfer, began, landed in timed:
            transfer.seconds = began.elapsed_time(landed) / 1e3
        return [transfer for transfer, _, _ in timed]

    def _offload_state(self) -> int:
        """Offload the state through the engine; returns the bytes that left the device."""
        before = sum(o.offloaded_bytes for o in self.offloaders)
        for offloader in self.offloaders:
            # Every chunk's copy queued at once, after the compute stream's work; kept chunks too (the
            # default keeps what fits): they stay kept, and the next step brings them back.
            offloader.offload(kept_too=True)
        for offloader in self.offloaders:
            # Blocks until the copies have landed and the engine has dropped the device memory they read.
            offloader.copies.drain()
        return sum(o.offloaded_bytes for o in self.offloaders) - before

    # ------------------------------------------------------------------------------------- wake
    def wake(self) -> SleepReport:
        """Bring back everything the last sleep moved, bitwise, ready for the next training step."""
        if not self.asleep:
            raise SleepError("not asleep: wake() follows a sleep()")
        free, allocated, _ = device_memory()
        report = SleepReport("wake", device_free_before=free, allocated_before=allocated)
        start = time.perf_counter()
        # The smallest first: the first part's allocation is the only one no copy runs beside.
        buffers = sorted((self.buffers[n] for n in self.asleep if n in self.buffers), key=lambda p: p.nbytes)
        queue = self.copies
        streams = queue.streams
        timed: list[tuple[Transfer, Event, Event]] = []  # (part, its copies started, they landed)
        link: Event | None = None
        for part in buffers:
            allocating = time.perf_counter()
            part.allocate()  # on the compute stream, while the link carries the previous part
            setup = time.perf_counter() - allocating
            # The allocator may hand out memory that kernels queued on the compute stream still use.
            copy = queue.put(part.copy_in(streams.mark()), now=True)
            timed.append((Transfer(part.name, part.nbytes, 0.0, setup), copy.began, copy.done))
            link = copy.done
        if link is not None:
            # Compute work must not read a buffer before its copy has landed; and the engine's copies,
            # which it orders after the compute stream's queued work, go behind the buffers' on the link.
            streams.wait(link)
        if OPTIMIZER in self.asleep and not self.held.state_lives_on_host:
            began = link or streams.mark(timed=True)
            moved = sum(o.offloaded_bytes for o in self.offloaders)
            for offloader in self.offloaders:
                offloader.wait()  # the compute stream is ordered after its copies, on the device
            # Reached once the engine's copies landed: the compute stream waits for them.
            timed.append((Transfer(OPTIMIZER, moved, 0.0), began, streams.mark(timed=True)))
        # On the host: when wake() returns every byte is in place (and the times are the transfers').
        queue.drain()
        report.transfers = self._timed(timed)
        report.seconds = time.perf_counter() - start
        if OPTIMIZER in self.asleep and self.held.state_lives_on_host:
            # The attached handle brings the state back during the next step, as after any step.
            report.transfers.append(Transfer(OPTIMIZER, 0, 0.0))
        report.device_free_after, report.allocated_after, report.reserved_after = device_memory()
        self.asleep, self.last_report = (), report
        return report

    def close(self) -> None:
        """Wake if asleep, give every tensor its own device storage back and free every host slab."""
        if self.asleep:
            self.wake()
        if not self.held.state_lives_on_host:
            for offloader in self.offloaders:
                offloader.restore()
        for part in self.buffers.values():
            part.release()
