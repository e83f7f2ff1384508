"""Move an optimizer's per-parameter state to host memory between steps, and back for the next one.

This module knows nothing of Megatron: it works on any ``torch.optim.Optimizer`` plus an optional
list of extra tensors (fp32 master weights kept outside the optimizer state).

The state is cut into chunks of whole parameters (a parameter's master and moments always share a
chunk). Each chunk moves on its own: it can come back early, while backward frees memory, or stream
through the optimizer step (copy in chunk i+2, update chunk i, copy out chunk i-1, in three reusable
staging buffers), so both copy directions run at once and the step never holds all the state.
Every copy goes through a copy lane (copy_lane.py): a helper thread per direction issues one chunk at
a time, after waiting on the host for what the copy depends on, and frees a chunk's GPU memory once
its copy out has landed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_offload.copy_lane import Completion, CopyJob, CopyLane
from megatron_offload.host_memory import HostSlab, check_host_room
from megatron_offload.timings import Timings

logger = logging.getLogger(__name__)

__all__ = ["OffloadStats", "OptimizerStateOffloader", "RestrictedStep"]

ALIGN = 256  # byte alignment of every tensor inside a chunk (and of chunks in the host slab)
DEFAULT_CHUNK_BYTES = 64 * 1024**2
# Chunks already on the GPU at the step are updated in groups of about this size: one optimizer call
# each (few launches), while the optimizer's temporaries (a foreach Adam makes some the size of a
# moment) stay bounded instead of growing with all that came back early.
READY_GROUP_BYTES = 512 * 1024**2
# Buffers the streamed step cycles through: one chunk copying in, one being updated, one copying out.
STAGING_CHUNKS = 3


@dataclass
class OffloadStats:
    """Running totals; copy times are read from CUDA events once they have completed, never by a sync.

    ``last_*`` figures are those of the latest optimizer step whose copies have all completed.
    """

    offloads: int = 0
    prefetches: int = 0
    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    bytes_streamed: int = 0
    """Bytes that came back through the pipelined step rather than ahead of it."""
    offload_seconds: float = 0.0
    prefetch_seconds: float = 0.0
    exposed_seconds: float = 0.0
    """Time the compute stream stood waiting for a copy-in: the copy time not hidden behind compute."""
    last_offload_seconds: float = 0.0
    last_prefetch_seconds: float = 0.0
    last_exposed_seconds: float = 0.0
    gpu_bytes_freed: int = 0
    """Bytes of device memory released by the latest offload (0 while the state is resident)."""
    host_bytes: int = 0
    """Size of the host slab: the offloaded state of this optimizer."""
    resident_bytes: int = 0
    """State kept on the GPU for good because of ``fraction`` < 1."""
    pinned: bool = True
    peak_allocated_bytes: int = 0
    """The device's peak allocated memory since its last reset (``torch.cuda.max_memory_allocated``)."""
    peak_reserved_bytes: int = 0
    """The device's peak reserved memory: what the GPU really had to hold (``max_memory_reserved``)."""


@dataclass
class _Entry:
    tensor: torch.Tensor  # the optimizer's own tensor object; its .data moves between GPU and host
    host: torch.Tensor  # view into the host slab, same shape and dtype
    host_offset: int  # byte offset in the host slab
    offset: int  # byte offset inside its chunk's device block
    nbytes: int
    is_param: bool  # an optimizer param (a master weight): megatron assigns its .grad during the step
    in_block: bool = True  # False for state the optimizer has just made, not yet in a block of ours


@dataclass
class _Chunk:
    entries: list[_Entry]
    params: list[torch.Tensor]  # the optimizer params whose state this chunk holds
    nbytes: int  # size of its device block
    offloaded: bool = False
    gpu: torch.Tensor | None = None  # uint8 device block the entries view while resident (None: their own)
    arriving: CopyJob | None = None  # copy-in not yet waited for by the compute stream
    touched: bool = False  # the compute stream may have changed it since it came back
    leaving: CopyJob | None = None  # latest copy-out; once done the host copy is complete and may be read


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """True when freeing the tensor's storage frees nothing but the tensor (no views of a shared buffer)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def _shaped_like(value: object, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value is not param and value.shape == param.shape


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _view(block: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    return block[offset : offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def _runs(entries: list[_Entry]) -> list[tuple[int, int, int]]:
    """(host offset, block offset, bytes) of each stretch that is contiguous on both sides: one copy each.
    A chunk has one, or two after Adam's first step added its moments at the end of the slab."""
    runs: list[list[int]] = []
    for entry in sorted(entries, key=lambda e: e.offset):
        size = _aligned(entry.nbytes)
        if runs and runs[-1][0] + runs[-1][2] == entry.host_offset and runs[-1][1] + runs[-1][2] == entry.offset:
            runs[-1][2] += size
        else:
            runs.append([entry.host_offset, entry.offset, size])
    return [(host, block, size) for host, block, size in runs]


class RestrictedStep:
    """Runs ``optimizer.step()`` over a subset of its params, once per chunk, as if it ran once.

    Every call sees the param-group settings as they were before the first call: apex's and
    TransformerEngine's FusedAdam count steps per group (``group["step"] += 1``), so without this a
    step cut into five chunks would count five steps. Per-element optimizers (every Adam) then give
    bitwise the same result as one call over all params.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[[], object] | None = None) -> None:
        self.optimizer = optimizer
        # The class's step: an instance attribute ``step`` may be a wrapper that calls us.
        self.step = step or functools.partial(type(optimizer).step, optimizer)
        self.settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]

    def __call__(self, params: Sequence[torch.Tensor]) -> None:
        wanted = {id(param) for param in params}
        groups = self.optimizer.param_groups
        every_param = [group["params"] for group in groups]
        try:
            for group, settings, group_params in zip(groups, self.settings, every_param, strict=True):
                for key in [key for key in group if key != "params" and key not in settings]:
                    del group[key]  # added by an earlier chunk's call, e.g. a first "step"
                group.update(settings)
                group["params"] = [param for param in group_params if id(param) in wanted]
            self.step()
        finally:
            for group, group_params in zip(groups, every_param, strict=True):
                group["params"] = group_params


class OptimizerStateOffloader:
    """Keeps an optimizer's tensor state (and given master weights) in host memory between steps.

    Lifecycle per iteration: ``offload()`` after the step; ``prefetch()`` (all, or as many bytes as
    memory allows) while the next iteration computes; then either ``wait()`` and the optimizer's own
    step, or ``run_step()``, which streams whatever has not come back through a pipelined step.

    NOTE: tensor objects are never replaced, only what they hold: offloading points each one's ``.data``
    at its host copy at once (the GPU storage is then held only by the copy-out lane, which frees it when
    the copy has landed; ``pending_out_bytes``, ``drain_out``) and prefetching points it at GPU memory.
    ``optimizer.state``, ``param_groups`` and outside references stay valid,
    and while offloaded a tensor is a CPU tensor with the right values: code that reads it gets the
    right numbers (after ``host_copies_ready()``), code that mixes it with GPU tensors gets a device
    error, and a write to it (a checkpoint load) lands in the host copy that the next prefetch brings back.
    NOTE: the set of tensors is looked up again at every ``offload()``. The moments Adam creates at its
    first step join their param's chunk (the slab was sized for them); a state-dict load that replaces
    tensors makes a new plan, in the same slab when it fits. The slab is pinned once in training.
    NOTE: an entry counts as offloadable when it has the parameter's shape (``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``, TransformerEngine's ``master_param``) in any dtype; scalars such as ``step``
    stay where they are. Entries that share storage with other tensors stay resident, with a warning.
    NOTE: a chunk that came back but was never handed to the compute stream (a skipped step) is not
    copied out again: its host copy is still exact, so its GPU memory is simply dropped.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        master_weights: Sequence[torch.Tensor] = (),
        *,
        keep_state_keys: Sequence[str] = (),
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        fraction: float = 1.0,
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
        if chunk_bytes <= 0:
            raise ValueError(f"--offload-chunk-mb must be positive, got {chunk_bytes / 1024**2:g} MB")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"--offload-fraction must be between 0 and 1, got {fraction}")
        self.optimizer = optimizer
        self.master_weights = list(master_weights)
        self.keep_state_keys = frozenset(keep_state_keys)
        self.chunk_bytes = chunk_bytes
        self.fraction = fraction
        self.pin_memory = pin_memory
        self.check_host_memory = check_host_memory
        self.stats = OffloadStats()
        self._chunks: list[_Chunk] = []
        self._planned: set[int] = set()  # id() of every tensor in the plan, offloaded or kept
        self._plan_key: tuple = ()
        self._slab: HostSlab | None = None
        self._loose_masters = False  # some master is not an optimizer param: run_step cannot chunk it
        self._slab_used = 0  # bytes of the slab the plan uses; Adam's first moments go after them
        self._kept_params: set[int] = set()  # params whose state stays on the GPU (fraction < 1)
        self._warned_shared: set[int] = set()
        self._device: torch.device | None = None
        self._out_lane: CopyLane | None = None
        self._in_lane: CopyLane | None = None
        self._out_stream: torch.cuda.Stream | None = None  # None without CUDA: the lanes copy synchronously
        self._in_stream: torch.cuda.Stream | None = None
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._step_index = 0
        self._timings = Timings()
        if check_host_memory:
            check_host_room(int(self.estimated_host_bytes() * fraction))

    # ----------------------------------------------------------------------------------- state
    @property
    def is_offloaded(self) -> bool:
        """True while any chunk of the state is in host memory only."""
        return any(chunk.offloaded for chunk in self._chunks)

    @property
    def offloaded_bytes(self) -> int:
        return sum(chunk.nbytes for chunk in self._chunks if chunk.offloaded)

    def estimated_host_bytes(self) -> int:
        """Host bytes this offloader will need at ``fraction`` 1: what exists now, or masters + two
        moments per parameter (Adam) before the first step has created the moments."""
        existing = sum(t.numel() * t.element_size() for t, _ in self._offloadable_tensors())
        if self._has_state():
            return existing
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return existing + 2 * sum(p.numel() * p.element_size() for p in params)

    def _offloadable_tensors(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """(tensor, the optimizer param it belongs to, or None for a loose master), in step order."""
        seen: set[int] = set()

        def fresh(tensor: torch.Tensor) -> bool:
            new = id(tensor) not in seen
            seen.add(id(tensor))
            return new and tensor.numel() > 0

        masters = {id(tensor) for tensor in self.master_weights}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) in masters and fresh(param):
                    yield param, param
                for key, value in self.optimizer.state.get(param, {}).items():
                    if key in self.keep_state_keys or not _shaped_like(value, param):
                        continue
                    if id(value) not in self._planned and not owns_its_storage(value):
                        if id(value) not in self._warned_shared:
                            self._warned_shared.add(id(value))
                            logger.warning("optimizer state %r shares its storage; keeping it on the GPU", key)
                        continue
                    if fresh(value):
                        yield value, param
        for tensor in self.master_weights:
            if fresh(tensor):
                yield tensor, None

    def _refresh_plan(self) -> None:
        """Re-make the chunks and host slab if the set of offloadable tensors changed. Needs every
        chunk resident (the caller waits first)."""
        found = list(self._offloadable_tensors())
        key = tuple((id(t), t.dtype, t.numel()) for t, _ in found)
        if self._slab is not None and key == self._plan_key:
            return
        # Cut into chunks of whole parameters, in the order the optimizer steps them. A param's size
        # counts the two Adam moments its first step will create, which then join its chunk.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors_of: dict[int, list[torch.Tensor]] = {}
        for tensor, param in found:
            tensors_of.setdefault(id(param) if param is not None else id(tensor), []).append(tensor)
        owners = [(p, tensors_of.get(id(p), [])) for p in params]
        owners += [(None, [t]) for t, p in found if p is None]  # masters outside the optimizer
        cuts: list[list[tuple[torch.Tensor | None, list[torch.Tensor], int]]] = []
        size = 0
        for param, tensors in owners:
            expected = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
            # (Megatron's masters do not require grad, yet Adam steps them: their grads are set by hand.)
            if param is not None and not self.optimizer.state.get(param):
                expected += 2 * _aligned(param.numel() * param.element_size())
            if not cuts or size >= self.chunk_bytes or param is None:
                cuts.append([])
                size = 0
            cuts[-1].append((param, tensors, expected))
            size += expected
        total = sum(expected for cut in cuts for _, _, expected in cut)
        # Offload whole chunks from the front, as near the fraction as chunks allow; keep the rest.
        offloaded, reserve, kept = [], 0, 0
        for cut in cuts:
            expected = sum(e for _, _, e in cut)
            if reserve + expected / 2 <= self.fraction * total:
                offloaded.append(cut)
                reserve += expected
            else:
                kept += sum(_aligned(t.numel() * t.element_size()) for _, tensors, _ in cut for t in tensors)
        host_bytes = sum(_aligned(t.numel() * t.element_size()) for c in offloaded for _, ts, _ in c for t in ts)
        self._make_room(reserve)
        chunks, start = [], 0
        for cut in offloaded:
            entries, offset = [], 0
            for param, tensors, _ in cut:
                for tensor in tensors:
                    nbytes = tensor.numel() * tensor.element_size()
                    host = _view(self._slab.tensor, start + offset, tensor)
                    # in_block False: the values exist only on the GPU so far; the first offload copies them.
                    entries.append(_Entry(tensor, host, start + offset, offset, nbytes, param is tensor, False))
                    offset += _aligned(nbytes)
            chunk_params = [param for param, _, _ in cut if param is not None]
            chunks.append(_Chunk(entries, chunk_params, offset, touched=True))
            start += offset
        self._chunks, self._plan_key, self._slab_used = chunks, key, start
        self._planned = {id(t) for t, _ in found}
        offloaded_params = {id(p) for chunk in chunks for p in chunk.params}
        self._kept_params = {id(p) for p in params if id(p) not in offloaded_params}
        self._loose_masters = any(param is None for cut in offloaded for param, _, _ in cut)
        self._device = found[0][0].device if found else (params[0].device if params else None)
        self.stats.host_bytes = host_bytes
        self.stats.resident_bytes = kept
        self.stats.pinned = self._slab.pinned or host_bytes == 0
        if found:
            logger.info(
                "offload plan: %d tensors in %d chunks, %.3f GiB offloaded, %.3f GiB kept on the GPU",
                len(found),
                len(chunks),
                host_bytes / 1024**3,
                kept / 1024**3,
            )

    def _has_state(self) -> bool:
        return any(self.optimizer.state.get(p) for group in self.optimizer.param_groups for p in group["params"])

    def _adopt_new_state(self, chunk: _Chunk) -> None:
        """Plan the state the optimizer has just created for the chunk's params (Adam's moments, at its
        first step) into the chunk, with host room at the end of the slab, so it leaves with the chunk
        instead of making the whole state come back for a new plan. No room: left for the next plan."""
        for param in chunk.params:
            for key, value in self.optimizer.state.get(param, {}).items():
                if id(value) in self._planned or key in self.keep_state_keys or not _shaped_like(value, param):
                    continue
                nbytes = value.numel() * value.element_size()
                if self._slab is None or self._slab_used + _aligned(nbytes) > self._slab.nbytes:
                    return
                host = _view(self._slab.tensor, self._slab_used, value)
                chunk.entries.append(_Entry(value, host, self._slab_used, chunk.nbytes, nbytes, False, in_block=False))
                self._slab_used += _aligned(nbytes)
                chunk.nbytes += _aligned(nbytes)
                self._planned.add(id(value))
                self.stats.host_bytes += _aligned(nbytes)

    def _settle_plan(self) -> None:
        """After a step: adopt the current tensor set as the plan if every tensor in it is planned
        (the moments of params kept on the GPU join the kept set)."""
        current = list(self._offloadable_tensors())
        for tensor, param in current:
            if id(tensor) not in self._planned:
                if param is None or id(param) not in self._kept_params:
                    return  # something new outside any chunk: the next offload makes a new plan
                self._planned.add(id(tensor))
                self.stats.resident_bytes += _aligned(tensor.numel() * tensor.element_size())
        self._plan_key = tuple((id(t), t.dtype, t.numel()) for t, _ in current)

    def _make_room(self, host_bytes: int) -> None:
        """Keep the host slab if it is large enough, else pin a new one of ``host_bytes``, which counts
        the moments Adam's first step will add, so that the slab is pinned only once."""
        if self._slab is not None and self._slab.nbytes >= host_bytes:
            self._finish_copies()  # no copy may still use the old layout
            return
        self._release_slab()
        if self.check_host_memory:
            # Other ranks on this node may have pinned theirs already: count only our own bytes here.
            check_host_room(host_bytes, ranks=1)
        self._slab = HostSlab(host_bytes, torch.uint8, self.pin_memory)

    def _finish_copies(self) -> None:
        """Block until every copy handed to a lane has completed."""
        for lane in (self._out_lane, self._in_lane):
            if lane is not None:
                lane.drain()

    def _release_slab(self) -> None:
        # A copy may still be reading or writing the old slab; it must be idle before we free it.
        self._finish_copies()
        if self._slab is not None:
            self._slab.release()
        self._chunks, self._slab, self._plan_key, self._planned = [], None, (), set()

    @property
    def _on_cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def _lanes(self) -> tuple[CopyLane, CopyLane]:
        """The copy-out and copy-in lanes, each with a side stream of its own (made on first use)."""
        if self._out_lane is None:
            device, on_cuda = self._device, self._on_cuda

            def setup() -> None:
                if on_cuda:
                    torch.cuda.set_device(device)  # the lane's thread issues copies for this device

            self._out_lane = CopyLane("megatron-offload-out", setup)
            self._in_lane = CopyLane("megatron-offload-in", setup)
            if on_cuda:
                self._out_stream, self._in_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
        return self._out_lane, self._in_lane

    def _compute_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self._device) if self._on_cuda else None

    def _compute_reached(self) -> torch.cuda.Event | None:
        """An event at the compute stream's current end: what a lane waits for (on the host) before
        its copy may read or overwrite memory the compute stream used."""
        if not self._on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._compute_stream())
        return event

    def _issuer(self, kind: str, stream: torch.cuda.Stream | None, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        """What a lane's thread calls to queue ``copies`` (destination, source) on ``stream``."""
        timing = self._timings.add(kind, self._step_index) if stream is not None else None

        def issue() -> torch.cuda.Event | None:
            if stream is None:  # no CUDA (tests): the copies are done when this returns
                for destination, source in copies:
                    destination.copy_(source)
                return None
            with torch.cuda.stream(stream):
                timing.record_start(stream)
                for destination, source in copies:
                    destination.copy_(source, non_blocking=True)
                return timing.record_end(stream)

        return issue

    # ------------------------------------------------------------------------ one chunk at a time
    def _copy_out(self, chunk: _Chunk, urgent: bool = False) -> None:
        """Hand a resident chunk to the copy-out lane, which copies it to host memory (if the compute
        stream may have changed it) and then frees its GPU memory; its tensors point at the host copy
        from now on."""
        out_lane, _ = self._lanes()
        copies, keep = [], []
        if chunk.gpu is not None:
            keep.append(chunk.gpu)
        slab = self._slab.tensor
        for host, offset, size in _runs([e for e in chunk.entries if e.in_block and chunk.gpu is not None]):
            copies.append((slab[host : host + size], chunk.gpu[offset : offset + size]))
        for entry in chunk.entries:
            if not (entry.in_block and chunk.gpu is not None):  # made by the optimizer, not in a block of ours
                keep.append(entry.tensor.data)
                copies.append((entry.host, entry.tensor.data))
        if chunk.touched:
            # The lane waits (on the host) for the compute stream to finish writing the chunk.
            ready = self._compute_reached()
            self.stats.bytes_offloaded += chunk.nbytes
        else:
            # Unchanged since it came back (a skipped step): the host copy is exact, nothing to copy;
            # the memory is freed once the copy-in that filled it has landed.
            copies, ready = [], chunk.arriving
        issue = self._issuer("offload", self._out_stream, copies) if copies else lambda: None
        job = CopyJob(issue, chunk.nbytes, ready, keep, urgent)
        chunk.leaving = out_lane.submit(job)
        for entry in chunk.entries:
            entry.tensor.data = entry.host  # our reference to the device memory is now only the job's
            entry.in_block = True  # the next copy-in puts it in the chunk's block
        chunk.gpu, chunk.arriving, chunk.touched, chunk.offloaded = None, None, False, True

    def _copy_in(
        self,
        chunk: _Chunk,
        block: torch.Tensor | None = None,
        ready: Completion | None = None,
        urgent: bool = False,
    ) -> None:
        """Hand an offloaded chunk to the copy-in lane, to come back into ``block`` (default: fresh
        device memory, allocated now on the compute stream) once ``ready`` has completed."""
        _, in_lane = self._lanes()
        if chunk.leaving is not None:
            chunk.leaving.synchronize()  # on the host: its host copy must be complete before it is read
            chunk.leaving = None
        if block is None:
            try:
                block = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self._device)
            except torch.OutOfMemoryError as error:
                raise torch.OutOfMemoryError(
                    f"megatron-offload: not enough GPU memory to bring back {chunk.nbytes / 1024**2:.0f} MiB "
                    "of optimizer state; the state is still whole in host memory. Use --offload-prefetch "
                    "step (the step streams the state through three chunks), lower --offload-chunk-mb, or "
                    f"reduce the micro-batch size. ({error})"
                ) from error
            # The allocator may have handed us memory compute work has just freed: the lane waits
            # (on the host) for the compute stream to get past that work before overwriting it.
            ready = ready or self._compute_reached()
        slab = self._slab.tensor
        runs = _runs(chunk.entries)
        copies = [(block[offset : offset + size], slab[host : host + size]) for host, offset, size in runs]
        job = CopyJob(self._issuer("prefetch", self._in_stream, copies), 0, ready, urgent=urgent)
        chunk.arriving = in_lane.submit(job)
        for entry in chunk.entries:
            entry.tensor.data = _view(block, entry.offset, entry.tensor)
        chunk.gpu, chunk.offloaded = block, False
        self.stats.bytes_prefetched += chunk.nbytes

    def _hand_to_compute(self, chunk: _Chunk) -> None:
        """Order the compute stream after the chunk's copy-in, timing how long it stands waiting."""
        if chunk.arriving is not None:
            if not self._on_cuda:
                chunk.arriving.synchronize()
            else:
                # The copy must be queued before the compute stream can wait for it; it is then ahead
                # of the wait in every hardware queue, so the wait can always proceed.
                landed = chunk.arriving.wait_issued()
                compute = self._compute_stream()
                timing = self._timings.add("exposed", self._step_index)
                timing.record_start(compute)
                compute.wait_event(landed)
                timing.record_end(compute)
            chunk.arriving = None
        chunk.touched = True

    # -------------------------------------------------------------------------------- transfers
    @torch.no_grad()
    def offload(self) -> None:
        """Hand every resident chunk to the copy-out lane: to host memory, then its GPU memory freed."""
        if self._slab is None or self._plan_key != self._current_key():
            self.wait()  # chunks still coming in must land before the plan can change
            self._refresh_plan()
        resident = [chunk for chunk in self._chunks if not chunk.offloaded]
        for chunk in resident:
            self._copy_out(chunk)
        if resident:
            self._count_offload()

    def _count_offload(self) -> None:
        if not self.stats.host_bytes:
            return  # nothing to move yet (Adam state not created, masters kept)
        self.stats.offloads += 1
        self.stats.gpu_bytes_freed = self.offloaded_bytes
        self._step_index += 1
        self._timings.harvest(self.stats)

    def _current_key(self) -> tuple:
        return tuple((id(t), t.dtype, t.numel()) for t, _ in self._offloadable_tensors())

    @torch.no_grad()
    def prefetch(self, max_bytes: int | None = None) -> int:
        """Start bringing offloaded chunks back, in step order, up to ``max_bytes`` (default: all).

        Returns at once with the bytes started; the compute stream is ordered after the copies by
        ``wait()`` or ``run_step()``.
        """
        started = 0
        # One mark for every block allocated here: no compute work is queued in between.
        reached = self._compute_reached() if any(chunk.offloaded for chunk in self._chunks) else None
        for chunk in self._chunks:
            if not chunk.offloaded:
                continue
            if max_bytes is not None and started + chunk.nbytes > max_bytes:
                break
            self._copy_in(chunk, ready=reached)
            started += chunk.nbytes
        if started:
            self.stats.prefetches += 1
            self.stats.gpu_bytes_freed = self.offloaded_bytes
        return started

    def wait(self) -> None:
        """Make the whole state usable by the compute stream: bring back what is still offloaded, then
        order the compute stream after every copy."""
        self.prefetch()
        for chunk in self._chunks:
            self._hand_to_compute(chunk)

    @property
    def pending_out_bytes(self) -> int:
        """GPU bytes of chunks handed to the copy-out lane and not freed yet."""
        return self._out_lane.pending_bytes if self._out_lane is not None else 0

    def drain_out(self, nbytes: int | None = None) -> int:
        """Block until copies out have freed at least ``nbytes`` of GPU memory (default: all of it),
        oldest first. Returns the bytes freed."""
        return self._out_lane.drain(nbytes) if self._out_lane is not None else 0

    @torch.no_grad()
    def run_step(self, after_chunk: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Run the optimizer step chunk by chunk and leave the state offloaded (copies out under way).

        Chunks already back are updated first, their copies out starting at once; the others stream
        through ``STAGING_CHUNKS`` buffers (copy in i+2, update i, copy out i-1 at once). The copy into
        a buffer is handed to its lane only after the copy out of the chunk that used it before has
        completed (a host wait), so no stream ever waits for another on the device.
        ``after_chunk(params)`` runs right after each chunk's update, while its state is on the GPU
        (Megatron copies the masters into the model there). State the optimizer creates on the way
        (Adam's moments, at its first step) joins its chunk and leaves with it. Falls back to one
        whole step when the plan no longer matches the state (after a load replaced tensors).
        NOTE: stepping a subset of params per call gives bitwise the same result as one call only for
        optimizers that update each param from its own state and gradient (Adam, AdamW, SGD), not for
        those that mix params (LAMB's global norm).
        """
        stepper = RestrictedStep(self.optimizer)
        all_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self._loose_masters or not self._chunks or self._plan_key != self._current_key():
            try:
                self.wait()
                stepper(all_params)
                if after_chunk is not None:
                    after_chunk(all_params)
            finally:
                self.offload()
            return
        ready = [chunk for chunk in self._chunks if not chunk.offloaded]
        streamed = [chunk for chunk in self._chunks if chunk.offloaded]
        resident_params = [p for p in all_params if id(p) in self._kept_params]  # kept by fraction < 1
        staging = [
            torch.empty(max((c.nbytes for c in streamed), default=0), dtype=torch.uint8, device=self._device)
            for _ in range(min(STAGING_CHUNKS, len(streamed)))
        ]
        fresh = self._compute_reached()  # the staging memory may have been freed by compute work just now
        self.stats.bytes_streamed += sum(chunk.nbytes for chunk in streamed)
        try:
            for index, chunk in enumerate(streamed[: STAGING_CHUNKS - 1]):
                self._copy_in(chunk, staging[index][: chunk.nbytes], ready=fresh, urgent=True)
            if resident_params:
                stepper(resident_params)
                if after_chunk is not None:
                    after_chunk(resident_params)
            for group in self._ready_groups(ready):
                for chunk in group:
                    self._hand_to_compute(chunk)
                params = [p for chunk in group for p in chunk.params]
                stepper(params)
                if after_chunk is not None:
                    after_chunk(params)
                for chunk in group:
                    self._adopt_new_state(chunk)
                    self._copy_out(chunk)
            for index, chunk in enumerate(streamed):
                self._hand_to_compute(chunk)
                stepper(chunk.params)
                if after_chunk is not None:
                    after_chunk(chunk.params)
                self._adopt_new_state(chunk)
                self._copy_out(chunk, urgent=True)  # the pipeline waits on it: ahead of the ready chunks
                upcoming = index + STAGING_CHUNKS - 1
                if upcoming < len(streamed):
                    buffer = staging[upcoming % STAGING_CHUNKS]
                    before = upcoming - STAGING_CHUNKS  # the chunk that used this buffer last
                    if before >= 0:
                        # On the host: once its copy out has read the buffer, the buffer may be overwritten.
                        streamed[before].leaving.synchronize()
                    ready_at = fresh if before < 0 else None
                    self._copy_in(streamed[upcoming], buffer[: streamed[upcoming].nbytes], ready=ready_at, urgent=True)
        finally:
            # Updated chunks leave with their new values; chunks never handed to compute are dropped.
            for chunk in self._chunks:
                if not chunk.offloaded:
                    self._copy_out(chunk)
            self._settle_plan()
            self._count_offload()

    def _ready_groups(self, ready: list[_Chunk]) -> Iterator[list[_Chunk]]:
        group: list[_Chunk] = []
        for chunk in ready:
            if group and sum(c.nbytes for c in group) + chunk.nbytes > max(READY_GROUP_BYTES, self.chunk_bytes):
                yield group
                group = []
            group.append(chunk)
        if group:
            yield group

    def step_footprint(self) -> int:
        """Most device memory ``run_step`` adds beyond what is already resident: the staging chunks, and
        optimizer temporaries for one group of ready chunks (counted at its full size, to be safe)."""
        largest = max((chunk.nbytes for chunk in self._chunks), default=self.chunk_bytes)
        return STAGING_CHUNKS * max(largest, self.chunk_bytes) + max(READY_GROUP_BYTES, self.chunk_bytes)

    @contextlib.contextmanager
    def params_on_device(self) -> Iterator[None]:
        """While inside, offloaded params (master weights) look like device tensors of the right shape
        (no memory behind them), so code that assigns their ``.grad`` before the step works; their
        values stay in host memory, and the step brings them back chunk by chunk."""
        swapped = []
        for chunk in self._chunks:
            for entry in chunk.entries:
                if chunk.offloaded and entry.is_param and self._on_cuda:
                    entry.tensor.data = self._placeholder(entry.tensor.dtype).expand(entry.tensor.shape)
                    swapped.append((chunk, entry))
        try:
            yield
        finally:
            for chunk, entry in swapped:
                if chunk.offloaded:
                    entry.tensor.data = entry.host

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty((), dtype=dtype, device=self._device)
        return self._placeholders[dtype]

    def host_copies_ready(self) -> None:
        """Block the host until every copy out has landed, so CPU code can read offloaded state."""
        for chunk in self._chunks:
            if chunk.offloaded and chunk.leaving is not None:
                chunk.leaving.synchronize()

    def restore(self) -> None:
        """Bring everything back to the device for good, each tensor in storage of its own again, and
        free the host slab (used at detach)."""
        self.wait()
        for chunk in self._chunks:
            if chunk.gpu is not None:  # one chunk at a time, so this costs one chunk of extra memory
                for entry in chunk.entries:
                    entry.tensor.data = entry.tensor.data.clone()
                chunk.gpu = None
        self._release_slab()
        for lane in (self._out_lane, self._in_lane):
            if lane is not None:
                lane.close()
        self._out_lane = self._in_lane = None

    def read_stats(self) -> OffloadStats:
        """The totals so far, including every copy that has completed by now (no sync)."""
        self._timings.harvest(self.stats)
        if self._on_cuda:
            self.stats.peak_allocated_bytes = torch.cuda.max_memory_allocated(self._device)
            self.stats.peak_reserved_bytes = torch.cuda.max_memory_reserved(self._device)
        return self.stats
