"""Move an optimizer's per-parameter state to host memory between steps, and back before the next.

This module knows nothing of Megatron: it works on any ``torch.optim.Optimizer`` plus an optional
list of extra tensors (fp32 master weights kept outside the optimizer state).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_offload.host_memory import HostSlab, check_host_room

logger = logging.getLogger(__name__)

__all__ = ["OffloadStats", "OptimizerStateOffloader"]


@dataclass
class OffloadStats:
    """Running totals; copy times are read from CUDA events once they have completed, never by a sync."""

    offloads: int = 0
    prefetches: int = 0
    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    offload_seconds: float = 0.0
    prefetch_seconds: float = 0.0
    last_offload_seconds: float = 0.0
    last_prefetch_seconds: float = 0.0
    exposed_seconds: float = 0.0
    """Time the compute stream stood waiting for a copy-in at ``wait()``: the copy time not hidden."""
    last_exposed_seconds: float = 0.0
    gpu_bytes_freed: int = 0
    """Bytes of device memory released by the latest offload (0 while the state is resident)."""
    host_bytes: int = 0
    """Size of the host slabs, all dtypes together."""
    pinned: bool = True


@dataclass
class _Entry:
    tensor: torch.Tensor  # the optimizer's own tensor object; its .data moves between GPU and host
    host: torch.Tensor  # view into a host slab, same shape and dtype
    nbytes: int


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """True when freeing the tensor's storage frees nothing but the tensor (no views of a shared buffer)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def _shaped_like(value: object, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value is not param and value.shape == param.shape


class OptimizerStateOffloader:
    """Keeps an optimizer's tensor state (and given master weights) in host memory between steps.

    Lifecycle per iteration: ``offload()`` after ``step()``; ``prefetch()`` while the next iteration
    computes; ``wait()`` right before the next ``step()``.

    NOTE: tensor objects are never replaced, only what they hold: offloading points each one's ``.data``
    at its host copy (the GPU storage, no longer referenced, goes back to the allocator) and prefetching
    points it at fresh GPU memory. ``optimizer.state``, ``param_groups`` and outside references stay
    valid, and while offloaded a tensor is a CPU tensor with the right values: code that reads it gets
    the right numbers (after ``host_copies_ready()``), code that mixes it with GPU tensors gets a device
    error, and a write to it (a checkpoint load) lands in the host copy that the next prefetch brings back.
    NOTE: the set of tensors is looked up again at every ``offload()``: Adam creates its moments at the
    first step, and a state-dict load may replace them. Host slabs are re-made only when that set
    changes, which in training happens once.
    NOTE: an entry counts as offloadable when it has the parameter's shape (``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``, TransformerEngine's ``master_param``) in any dtype; scalars such as ``step``
    stay where they are. Entries that share storage with other tensors stay resident, with a warning.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        master_weights: Sequence[torch.Tensor] = (),
        *,
        keep_state_keys: Sequence[str] = (),
        pin_memory: bool = True,
        check_host_memory: bool = True,
    ) -> None:
        for tensor in master_weights:
            if not owns_its_storage(tensor):
                raise ValueError(
                    "a master weight given to OptimizerStateOffloader is a view into a larger buffer "
                    f"(shape {tuple(tensor.shape)}, storage of {tensor.untyped_storage().nbytes()} bytes); "
                    "freeing it would free memory others use. Pass only tensors with storage of their own."
                )
        self.optimizer = optimizer
        self.master_weights = list(master_weights)
        self.keep_state_keys = frozenset(keep_state_keys)
        self.pin_memory = pin_memory
        self.check_host_memory = check_host_memory
        self.stats = OffloadStats()
        self._entries: list[_Entry] = []
        self._plan_key: tuple = ()
        self._slabs: list[HostSlab] = []
        self._offloaded = False
        self._warned_shared: set[int] = set()
        self._device: torch.device | None = None
        self._offload_stream: torch.cuda.Stream | None = None
        self._prefetch_stream: torch.cuda.Stream | None = None
        self._offload_done: torch.cuda.Event | None = None  # last copy-out, for the copy-in to wait on
        self._prefetch_done: torch.cuda.Event | None = None  # set while a copy-in is not yet waited for
        self._pending_timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        if check_host_memory:
            check_host_room(self.estimated_host_bytes())

    # ----------------------------------------------------------------------------------- state
    @property
    def is_offloaded(self) -> bool:
        return self._offloaded

    def estimated_host_bytes(self) -> int:
        """Host bytes this offloader will need: what exists now, or masters + two moments per parameter
        (Adam) before the first step has created the moments."""
        existing = sum(t.numel() * t.element_size() for t in self._offloadable_tensors())
        if any(self.optimizer.state.get(p) for group in self.optimizer.param_groups for p in group["params"]):
            return existing
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return existing + 2 * sum(p.numel() * p.element_size() for p in params)

    def _offloadable_tensors(self) -> Iterator[torch.Tensor]:
        seen: set[int] = set()

        def fresh(tensor: torch.Tensor) -> bool:
            new = id(tensor) not in seen
            seen.add(id(tensor))
            return new and tensor.numel() > 0

        for tensor in self.master_weights:
            if fresh(tensor):
                yield tensor
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                for key, value in self.optimizer.state.get(param, {}).items():
                    if key in self.keep_state_keys or not _shaped_like(value, param):
                        continue
                    if not owns_its_storage(value):
                        if id(value) not in self._warned_shared:
                            self._warned_shared.add(id(value))
                            logger.warning("optimizer state %r shares its storage; keeping it on the GPU", key)
                        continue
                    if fresh(value):
                        yield value

    def _refresh_plan(self) -> None:
        """Re-make the host slabs if the set of offloadable tensors changed since the last offload."""
        tensors = list(self._offloadable_tensors())
        key = tuple((id(t), t.dtype, t.numel()) for t in tensors)
        if key == self._plan_key:
            return
        self._release_slabs()
        sizes: dict[torch.dtype, int] = {}
        for tensor in tensors:
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
        total = sum(numel * dtype.itemsize for dtype, numel in sizes.items())
        if self.check_host_memory:
            # Other ranks on this node may have pinned theirs already: count only our own bytes here.
            check_host_room(total, ranks=1)
        slabs = {dtype: HostSlab(numel, dtype, self.pin_memory) for dtype, numel in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        entries = []
        for tensor in tensors:
            start = offsets[tensor.dtype]
            offsets[tensor.dtype] = start + tensor.numel()
            host = slabs[tensor.dtype].tensor[start : start + tensor.numel()].view(tensor.shape)
            entries.append(_Entry(tensor, host, tensor.numel() * tensor.element_size()))
        self._entries, self._plan_key, self._slabs = entries, key, list(slabs.values())
        self._device = tensors[0].device if tensors else None
        self.stats.host_bytes = total
        self.stats.pinned = all(slab.pinned for slab in self._slabs)
        if tensors:
            logger.info("offload plan: %d tensors, %.3f GiB of host memory", len(tensors), total / 1024**3)

    def _release_slabs(self) -> None:
        if self._slabs and self._on_cuda:
            # A copy may still be reading or writing the old slabs; they must be idle before we free them.
            torch.cuda.synchronize(self._device)
        for slab in self._slabs:
            slab.release()
        self._entries, self._slabs, self._plan_key = [], [], ()

    @property
    def _on_cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def _streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._offload_stream is None:
            self._offload_stream = torch.cuda.Stream(self._device)
            self._prefetch_stream = torch.cuda.Stream(self._device)
        return self._offload_stream, self._prefetch_stream

    # -------------------------------------------------------------------------------- transfers
    @torch.no_grad()
    def offload(self) -> None:
        """Copy the state to host memory on a side stream and release its device memory. Idempotent."""
        if self._offloaded:
            return
        self.wait()  # a copy-in still in flight must land before we copy out and free
        self._refresh_plan()
        if not self._entries:
            return
        self._harvest_timings()
        if self._on_cuda:
            offload_stream, _ = self._streams()
            # The step that just ran on the compute stream must finish writing the state first.
            offload_stream.wait_stream(torch.cuda.current_stream(self._device))
        with self._timed("offload", self._offload_stream):
            for entry in self._entries:
                entry.host.copy_(entry.tensor, non_blocking=True)
        for entry in self._entries:
            if self._on_cuda:
                # The allocator must not hand this memory to new work until the copy out has read it.
                entry.tensor.record_stream(self._offload_stream)
            entry.tensor.data = entry.host  # drops the last reference to the GPU storage
        self._offloaded = True
        moved = sum(entry.nbytes for entry in self._entries)
        self.stats.offloads += 1
        self.stats.bytes_offloaded += moved
        self.stats.gpu_bytes_freed = moved

    @torch.no_grad()
    def prefetch(self) -> None:
        """Allocate the state on the device again and start copying it back on a side stream.

        Returns at once; ``wait()`` orders the compute stream after the copy. Does nothing when the
        state is resident or a copy-in is already in flight.
        """
        if not self._offloaded:
            return
        try:
            # Allocated on the compute stream, so the memory is ordered after its earlier users there.
            fresh = [torch.empty_like(entry.host, device=self._device) for entry in self._entries]
        except torch.OutOfMemoryError as error:
            needed = sum(entry.nbytes for entry in self._entries)
            raise torch.OutOfMemoryError(
                f"megatron-offload: not enough GPU memory to bring back {needed / 1024**3:.2f} GiB of "
                "optimizer state for the step; the state is still whole in host memory. Reduce the "
                "micro-batch size or activation memory, or keep master weights resident with "
                f"--no-offload-master-weights. ({error})"
            ) from error
        if self._on_cuda:
            _, prefetch_stream = self._streams()
            # The new blocks may have just been freed by compute work; that work must be done first.
            prefetch_stream.wait_stream(torch.cuda.current_stream(self._device))
            # The host copy written by the last offload must be complete before we read it.
            prefetch_stream.wait_event(self._offload_done)
        with self._timed("prefetch", self._prefetch_stream) as done:
            for entry, memory in zip(self._entries, fresh, strict=True):
                memory.copy_(entry.host, non_blocking=True)
        for entry, memory in zip(self._entries, fresh, strict=True):
            entry.tensor.data = memory
        self._prefetch_done = done
        self._offloaded = False
        self.stats.prefetches += 1
        self.stats.bytes_prefetched += sum(entry.nbytes for entry in self._entries)
        self.stats.gpu_bytes_freed = 0

    def wait(self) -> None:
        """Make the state usable by the compute stream: start a copy-in if none is running, then order
        the compute stream after it. No host synchronization."""
        self.prefetch()
        if self._prefetch_done is not None:
            compute = torch.cuda.current_stream(self._device)
            arrived, resumed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            arrived.record(compute)
            # Work queued after this point (the optimizer step) must see the copied-in values.
            compute.wait_event(self._prefetch_done)
            resumed.record(compute)  # arrived -> resumed is how long compute stood waiting for the copy
            self._pending_timings.append(("exposed", arrived, resumed))
            self._prefetch_done = None

    def host_copies_ready(self) -> None:
        """Block the host until the last copy out has landed, so CPU code can read offloaded state."""
        if self._offloaded and self._on_cuda and self._offload_done is not None:
            self._offload_done.synchronize()

    def restore(self) -> None:
        """Bring everything back to the device for good, and free the host slabs (used at detach)."""
        self.wait()
        self._release_slabs()

    # ------------------------------------------------------------------------------- telemetry
    @contextlib.contextmanager
    def _timed(self, kind: str, stream: torch.cuda.Stream | None) -> Iterator[torch.cuda.Event | None]:
        """Run copies on ``stream`` between two timing events; yields the end event (None on CPU)."""
        if not self._on_cuda:
            yield None
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            yield end
            end.record(stream)
        if kind == "offload":
            self._offload_done = end
        self._pending_timings.append((kind, start, end))

    def _harvest_timings(self) -> None:
        """Add up the copy times whose events have completed; leave the rest for later."""
        still_pending = []
        for kind, start, end in self._pending_timings:
            if not end.query():
                still_pending.append((kind, start, end))
                continue
            seconds = start.elapsed_time(end) / 1000
            setattr(self.stats, f"{kind}_seconds", getattr(self.stats, f"{kind}_seconds") + seconds)
            setattr(self.stats, f"last_{kind}_seconds", seconds)
        self._pending_timings = still_pending

    def read_stats(self) -> OffloadStats:
        """The totals so far, including every copy that has completed by now (no sync)."""
        self._harvest_timings()
        return self.stats
