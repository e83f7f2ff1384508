"""Move an optimizer's per-parameter state to host memory between steps, and back for the next one.

This module knows nothing of Megatron: it works on any ``torch.optim.Optimizer`` plus an optional list
of extra tensors (fp32 master weights kept outside the optimizer state). The plan (plan.py) cuts the
state into chunks of whole parameters; this class moves them, chunk by chunk, on a side stream per
direction (streams.py), with no thread of its own: every copy is queued by the thread that calls it,
at points it passes anyway (the step, the hooks of the training loop, ``pump()``).

A copy is *queued* first, with what must have completed before it may start (the compute stream's
last write to a chunk going out; the compute work that last used the memory a chunk comes back
into). ``pump()`` starts queued copies whose dependency has completed, at most ``IN_FLIGHT`` per
direction, and retires those that have landed, freeing the GPU memory a copy out read. It never
waits: a copy whose dependency is not done is left for the next point. Two things may order the
device instead, where the caller needs the data now: ``hand_to_compute`` (the compute stream waits
for a chunk's copy back) and ``flush`` (every queued copy starts, its stream waiting on the device for
a dependency that is already queued).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from megatron_offload.core.host_memory import HostSlab, check_host_room
from megatron_offload.core.stats import OffloadStats, Timings
from megatron_offload.core.streams import OFFLOAD, PREFETCH, Event, Streams, streams_for
from megatron_offload.core.units import GIB, MIB
from megatron_offload.optimizer_state import plan as planning
from megatron_offload.optimizer_state.plan import Chunk, Plan

logger = logging.getLogger(__name__)

__all__ = ["IN_FLIGHT", "OffloadCopyError", "OptimizerStateOffloader"]

DEFAULT_CHUNK_BYTES = 64 * MIB
# Copies started per direction and not yet landed. The copy engine serves a direction in the order
# copies were queued, so a read queued behind them (a loss .item(), Megatron's after every step) waits
# for these at most: two chunks of 64 MiB, 2.6 ms at 52 GB/s. Two, so that the link stays busy
# between two points of the training loop.
IN_FLIGHT = 2


class OffloadCopyError(RuntimeError):
    """A copy of optimizer state failed; the message names the chunk and the direction."""


@dataclass(eq=False)
class Copy:
    """The copies of one chunk in one direction, from queued to landed."""

    chunk: Chunk
    direction: str
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source)
    block: torch.Tensor | None  # the GPU memory it reads (offload) or fills (prefetch): held until it landed
    after: Event | None  # must have completed before the copy may start
    keep: list[torch.Tensor] = field(default_factory=list)  # tensors of their own it reads: held until it landed
    in_block: list[bool] = field(default_factory=list)  # offload: per entry, read from the block (else from keep)
    done: Event | None = None  # set once started


class OptimizerStateOffloader:
    """Keeps an optimizer's tensor state (and given master weights) in host memory between steps.

    Lifecycle per iteration: ``offload(now=False)`` queues the state out after the step; ``pump()`` at
    the training loop's points moves it; ``prefetch(max_bytes)`` queues it back as memory allows;
    ``streamed_step.run`` steps chunk by chunk, streaming whatever is not back yet.

    NOTE: tensor objects are never replaced, only what they hold: a chunk's tensors point at its GPU
    block until its copy out starts, then at their host copy, which is whole once that copy has landed
    (``host_copies_ready()`` before reading it on the CPU). A copy holds the GPU memory it reads or
    fills until it has landed, so the allocator never hands that memory out while a copy uses it.
    NOTE: ``offload()`` and the streamed step check the plan against the state (one walk each): a tensor
    the plan does not hold, or ``plan_dirty`` (set after a checkpoint load), makes a new plan. Adam's
    moments, made at its first step, join their param's chunk (the slab was sized for them).
    NOTE: kept chunks (``fraction`` below 1, or chosen for ``auto``) are planned into the slab too, so
    they can leave at once should memory run short.
    NOTE: a chunk that came back but was never handed to the compute stream (a skipped step) is not
    copied again: its host copy is still exact.
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
        streams: Streams | None = None,
    ) -> None:
        for tensor in master_weights:
            if not planning.owns_its_storage(tensor):
                raise ValueError(
                    "a master weight given to OptimizerStateOffloader is a view into a larger buffer "
                    f"(shape {tuple(tensor.shape)}, storage of {tensor.untyped_storage().nbytes()} bytes); "
                    "freeing it would free memory others use. Pass only tensors with storage of their own."
                )
        if chunk_bytes <= 0:
            raise ValueError(f"--offload-chunk-mb must be positive, got {chunk_bytes / MIB:g} MB")
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
        self.timings = Timings()
        self.plan = Plan()
        self.plan_dirty = True
        self.kept_bytes = 0  # state kept on the GPU, counting the moments to come (see _count_plan)
        self.leaving_bytes = 0  # GPU bytes of chunks queued or in flight out (freed when they land)
        self.step_index = 0
        params = planning.all_params(optimizer)
        self.device: torch.device | None = params[0].device if params else None
        self.streams = streams or streams_for(self.device)
        self._queued: dict[str, deque[Copy]] = {OFFLOAD: deque(), PREFETCH: deque()}
        self._flying: dict[str, deque[Copy]] = {OFFLOAD: deque(), PREFETCH: deque()}
        self._slab: HostSlab | None = None
        self._warned_shared: set[int] = set()
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        if check_host_memory:
            check_host_room(self.estimated_host_bytes())

    # ----------------------------------------------------------------------------------- state
    @property
    def chunks(self) -> list[Chunk]:
        return self.plan.chunks

    @property
    def is_offloaded(self) -> bool:
        """True while any chunk of the state is in host memory only."""
        return any(not chunk.on_gpu for chunk in self.chunks)

    @property
    def offloaded_bytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks if not chunk.on_gpu)

    @property
    def slab(self) -> torch.Tensor:
        return self._slab.tensor

    @property
    def idle(self) -> bool:
        """No copy queued or in flight: the hooks' fast way out."""
        return not (self._flying[OFFLOAD] or self._flying[PREFETCH] or self._queued[OFFLOAD] or self._queued[PREFETCH])

    def estimated_host_bytes(self) -> int:
        """Host bytes this offloader will need: what exists now, or masters + two moments per parameter
        (Adam) before the first step has created the moments. Kept chunks are planned into the slab too."""
        existing = sum(planning.nbytes_of(t) for t, _ in self._offloadable())
        if any(self.optimizer.state.get(p) for p in planning.all_params(self.optimizer)):
            return existing
        return existing + 2 * sum(planning.nbytes_of(p) for p in planning.all_params(self.optimizer))

    def _offloadable(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        return planning.offloadable_tensors(
            self.optimizer, self.master_weights, self.keep_state_keys, self.plan.planned, self._warned_shared
        )

    def _refresh_plan(self) -> None:
        """Re-make the chunks (in the same slab when it is large enough) if the set of offloadable
        tensors changed. Brings every chunk back first: a new plan starts from tensors on the GPU."""
        self.plan_dirty = False
        found = list(self._offloadable())
        key = planning.plan_key(found)
        if self._slab is not None and key == self.plan.key:
            return
        self.wait()
        self.drain()  # no copy may still read or write the slab in the old layout
        cuts = planning.cut(self.optimizer, found, self.chunk_bytes)
        self._make_room(sum(expected for piece in cuts for _, _, expected in piece))
        sizes = [sum(expected for _, _, expected in piece) for piece in cuts]
        self.plan = planning.lay_out(cuts, self._slab.tensor, key, planning.kept_from(sizes, self.fraction))
        self.count_plan()
        self.stats.pinned = self._slab.pinned or not self.chunks
        if found:
            logger.info(
                "offload plan: %d tensors in %d chunks, %.3f GiB offloaded, %.3f GiB kept on the GPU",
                len(found),
                len(self.chunks),
                self.stats.offloaded_bytes / GIB,
                self.stats.kept_bytes / GIB,
            )

    def count_plan(self) -> None:
        """Recount after the plan or its kept flags changed (not per step: the hooks read the results)."""
        self.stats.host_bytes = self.plan.host_bytes
        self.stats.kept_bytes = self.plan.kept_bytes(to_come=False)
        self.kept_bytes = self.plan.kept_bytes()  # with Adam's moments to come: what the scheduler budgets

    def prepare(self) -> None:
        """Plan the state and pin its host slab now (about 0.5 s per GiB), so that the first offload
        runs at link speed instead of pinning on the way. No copies are made."""
        if self._slab is None and not self.is_offloaded:
            self._refresh_plan()

    def set_fraction(self, fraction: float) -> None:
        """Offload this share of the state from now on (whole chunks from the front): chunks no longer
        kept leave at the next ``offload()``; newly kept ones come back through the next step and stay."""
        self.fraction = fraction
        first_kept = planning.kept_from([max(c.nbytes, c.expected) for c in self.chunks], fraction)
        for chunk in self.chunks:
            chunk.kept = chunk.index >= first_kept
        self.count_plan()

    def evict(self, nbytes: int) -> int:
        """Offload kept chunks on the GPU, from the front, until ``nbytes`` are under way (memory ran
        short); they stay offloaded. Returns the bytes queued."""
        started = 0
        for chunk in self.chunks:
            if started >= nbytes:
                break
            if chunk.kept and chunk.on_gpu:
                chunk.kept = False
                self.queue_offload(chunk)
                started += chunk.nbytes
        self.count_plan()
        self.flush()
        return started

    def _make_room(self, host_bytes: int) -> None:
        """Keep the host slab if it is large enough, else pin a new one of ``host_bytes``, which counts
        the moments Adam's first step will add, so that the slab is pinned only once."""
        if self._slab is not None and self._slab.nbytes >= host_bytes:
            return
        self._release_slab()
        if self.check_host_memory:
            # Other ranks on this node may have pinned theirs already: count only our own bytes here.
            check_host_room(host_bytes, ranks=1)
        self._slab = HostSlab(host_bytes, torch.uint8, self.pin_memory)

    def _release_slab(self) -> None:
        self.drain()  # a copy may still be reading or writing the old slab: idle before freeing it
        if self._slab is not None:
            self._slab.release()
        self.plan, self._slab = Plan(), None
        self.count_plan()

    # ------------------------------------------------------------------------------ the copies
    def compute_mark(self) -> Event | None:
        return self.streams.mark()

    def new_block(self, nbytes: int) -> torch.Tensor:
        """Device memory for state, from the compute stream's pool."""
        try:
            return self.streams.block(nbytes)
        except torch.OutOfMemoryError as error:
            raise torch.OutOfMemoryError(
                f"megatron-offload: not enough GPU memory to bring back {nbytes / MIB:.0f} MiB of optimizer "
                "state; the state is still whole in host memory. Use --offload-prefetch step (the step streams "
                f"the state through three chunks), lower --offload-chunk-mb, or reduce the micro-batch size. ({error})"
            ) from error

    def queue_offload(self, chunk: Chunk, now: bool = False) -> Copy | None:
        """Queue the chunk's copy to host after the compute stream's last write to it, and point its
        tensors at the host copy when the copy starts. ``now``: start it at once (its stream waits on the
        device for that write, already queued). An unchanged chunk is dropped, not copied."""
        if chunk.copy is not None and chunk.copy.direction == PREFETCH and chunk.copy.done is None:
            self._cancel(chunk.copy)  # a copy back that never started: the chunk is still on the host
        if not chunk.on_gpu or self._leaving(chunk):
            return None
        if not chunk.touched:
            # Its host copy is exact: nothing to copy. A copy still filling the block holds it till it lands.
            chunk.copy = None
            self._point_at_host(chunk)
            return None
        pairs, keep, slab = [], [], self._slab.tensor
        in_block = [chunk.block is not None and entry.in_block for entry in chunk.entries]
        for host, offset, size in planning.runs([e for e, b in zip(chunk.entries, in_block, strict=True) if b]):
            pairs.append((slab[host : host + size], chunk.block[offset : offset + size]))
        for entry, in_it in zip(chunk.entries, in_block, strict=True):
            if not in_it:  # storage of its own (made by the optimizer, or before the first offload)
                keep.append(entry.tensor.data)
                pairs.append((entry.host, entry.tensor.data))
        copy = Copy(chunk, OFFLOAD, pairs, chunk.block, self.compute_mark(), keep, in_block)
        chunk.copy = copy
        self.leaving_bytes += chunk.nbytes
        self.stats.bytes_offloaded += chunk.nbytes
        self._queued[OFFLOAD].append(copy)
        if now:
            self.start(copy)
        return copy

    def queue_prefetch(self, chunk: Chunk, block: torch.Tensor | None = None, after: Event | None = None) -> Copy:
        """Queue the chunk's copy back into ``block`` (default: a new block; ``after`` then defaults to
        the compute stream's current end, as that memory may have been used by work still queued)."""
        if block is None:
            block = self.new_block(chunk.nbytes)
            after = after or self.compute_mark()
        slab = self._slab.tensor
        pairs = [
            (block[offset : offset + size], slab[host : host + size])
            for host, offset, size in planning.runs(chunk.entries)
        ]
        copy = Copy(chunk, PREFETCH, pairs, block, after)
        chunk.copy = copy
        self.stats.bytes_prefetched += chunk.nbytes
        self._queued[PREFETCH].append(copy)
        return copy

    def pump(self) -> None:
        """One point of the training loop: retire copies that have landed, start queued ones whose
        dependency has completed, at most ``IN_FLIGHT`` per direction. Never waits; raises a failed
        copy here, named."""
        self._retire_landed()
        for direction in (OFFLOAD, PREFETCH):
            flying, queued = self._flying[direction], self._queued[direction]
            while queued and len(flying) < IN_FLIGHT:
                copy = queued[0]
                if copy.after is not None and not self._query(copy, copy.after):
                    break  # its dependency is still running: left for the next point
                queued.popleft()
                self._start(copy, device_wait=False)

    def _retire_landed(self) -> None:
        for flying in self._flying.values():
            while flying and self._query(flying[0], flying[0].done):
                self._retire(flying.popleft())

    def flush(self) -> None:
        """Start every queued copy now; each stream waits on the device for dependencies already queued."""
        for direction in (OFFLOAD, PREFETCH):
            while self._queued[direction]:
                self._start(self._queued[direction].popleft(), device_wait=True)

    def drain(self, nbytes: int | None = None) -> int:
        """Block the host until copies out have freed at least ``nbytes`` of GPU memory (default: every
        copy, both ways, has landed), oldest first. Returns the bytes freed. Not for the steady state:
        checkpoints, detach, and a forward that outgrew its forecast."""
        freed = 0
        self.flush()
        directions = (OFFLOAD,) if nbytes is not None else (OFFLOAD, PREFETCH)
        for direction in directions:
            flying = self._flying[direction]
            while flying and (nbytes is None or freed < nbytes):
                copy = flying.popleft()
                try:
                    copy.done.synchronize()  # on the host: the caller needs this memory or data now
                except RuntimeError as error:
                    self._fail(copy, error)
                freed += copy.chunk.nbytes if direction == OFFLOAD and copy.chunk.copy is copy else 0
                self._retire(copy)
        return freed

    def start(self, copy: Copy) -> None:
        """Start a queued copy now, its stream waiting on the device for a dependency already queued."""
        self._queued[copy.direction].remove(copy)
        self._start(copy, device_wait=True)

    def _cancel(self, copy: Copy) -> None:
        """Forget a copy that has not started: a chunk going out stays on the GPU, one coming back stays
        on the host (its new block, unwritten, goes back to the allocator)."""
        self._queued[copy.direction].remove(copy)
        if copy.direction == OFFLOAD:
            self.leaving_bytes -= copy.chunk.nbytes
        copy.chunk.copy = None

    def _start(self, copy: Copy, device_wait: bool) -> None:
        chunk = copy.chunk
        after = copy.after if device_wait and copy.after is not None and not copy.after.query() else None
        try:
            start, copy.done = self.streams.copy(copy.direction, copy.pairs, after)
        except RuntimeError as error:
            self._fail(copy, error)
        if self.streams.timed:
            self.timings.add(copy.direction, self.step_index, start, copy.done)
        self._flying[copy.direction].append(copy)
        if copy.direction == OFFLOAD:
            self._point_at_host(chunk)
        else:
            for entry in chunk.entries:
                entry.tensor.data = planning.view(copy.block, entry.offset, entry.tensor)
            chunk.on_gpu, chunk.block, chunk.ready = True, copy.block, copy.done

    @staticmethod
    def _leaving(chunk: Chunk) -> bool:
        return chunk.copy is not None and chunk.copy.direction == OFFLOAD

    def _point_at_host(self, chunk: Chunk) -> None:
        for entry in chunk.entries:
            entry.tensor.data = entry.host  # the GPU memory is now held only by the copy reading it
            entry.in_block = True  # the next copy back puts it in the chunk's block
        chunk.on_gpu, chunk.block, chunk.ready, chunk.touched = False, None, None, False

    def _query(self, copy: Copy, event: Event) -> bool:
        try:
            return event.query()
        except RuntimeError as error:
            self._fail(copy, error)

    def _retire(self, copy: Copy) -> None:
        """The copy has landed: drop the memory it held (freed now, nothing reads it any more)."""
        chunk = copy.chunk
        if chunk.copy is copy:
            chunk.copy = None
            if copy.direction == OFFLOAD:
                self.leaving_bytes -= chunk.nbytes
            elif chunk.ready is copy.done:
                chunk.ready = None  # landed: the compute stream need not wait for it
        copy.pairs, copy.block, copy.keep = [], None, []

    def _fail(self, copy: Copy, error: BaseException) -> None:
        """Point the chunk at a whole copy of its data (the GPU memory a failed copy out read; the host
        copy a failed copy back was filling from) and raise, naming the chunk and direction."""
        chunk = copy.chunk
        for waiting in (self._flying[copy.direction], self._queued[copy.direction]):
            if copy in waiting:
                waiting.remove(copy)
        if copy.direction == OFFLOAD:
            self._point_at_sources(copy)
            chunk.touched = True
            self.leaving_bytes -= chunk.nbytes
        else:
            self._point_at_host(chunk)
        chunk.copy = None
        where = "GPU to host" if copy.direction == OFFLOAD else "host to GPU"
        raise OffloadCopyError(
            f"megatron-offload: copy of optimizer state failed: {chunk.label(len(self.chunks))}, {where} "
            f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); nothing was lost on this chunk; "
            "stop and resume from the last complete checkpoint."
        ) from error

    # ----------------------------------------------------------------------- whole-state moves
    def plan_is_current(self) -> bool:
        """Every offloadable tensor is in the plan (the moments Adam's first step made were adopted into
        their chunks); then the plan is the state's. One walk over the state."""
        found = list(self._offloadable())
        if self.plan_dirty or self._slab is None or not all(id(tensor) in self.plan.planned for tensor, _ in found):
            return False
        self.plan.key = planning.plan_key(found)
        return True

    @torch.no_grad()
    def offload(self, now: bool = True) -> None:
        """Queue every chunk on the GPU that is not kept to leave; ``now``: start every copy at once
        (``False``: the training loop's points start them, a few at a time). A new set of state tensors
        (a load replaced them) gets a new plan first."""
        if not self.plan_is_current():
            self._refresh_plan()
        queued = self.queue_out()
        if now:
            self.flush()
        if queued:
            self.count_step()

    def queue_out(self) -> bool:
        """Queue every chunk on the GPU that is not kept and not leaving yet, on the plan as it stands
        (copies back that never started are dropped: those chunks stay on the host). True if any was."""
        for copy in list(self._queued[PREFETCH]):
            if not copy.chunk.kept:
                self._cancel(copy)
        leaving = [chunk for chunk in self.chunks if chunk.on_gpu and not chunk.kept and not self._leaving(chunk)]
        for chunk in leaving:
            self.queue_offload(chunk)
        return bool(leaving)

    def count_step(self) -> None:
        if not self.stats.host_bytes or all(chunk.kept for chunk in self.chunks):
            return  # nothing moves (no state yet, masters kept, or all of it kept)
        self.stats.offloads += 1
        self.stats.gpu_bytes_freed = sum(chunk.nbytes for chunk in self.chunks if not chunk.kept)  # out, or leaving
        self.step_index += 1
        self.timings.harvest(self.stats)

    @torch.no_grad()
    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False) -> int:
        """Queue offloaded chunks back, in step order, up to ``max_bytes`` (default: all), and start
        what may start. A chunk whose copy out has not started yet simply stays. With ``landed_only``,
        only chunks whose copy out has landed (the backward's hooks). Returns the bytes queued."""
        started, mark = 0, None
        self._retire_landed()  # a chunk whose copy out has landed is on the host, not leaving
        for chunk in self.chunks:
            copy = chunk.copy
            if copy is not None and copy.direction == PREFETCH:
                continue  # on its way back already
            if copy is not None and copy.done is None:
                self._cancel(copy)  # its copy out has not started: the chunk never left
                continue
            if chunk.on_gpu or (landed_only and copy is not None):
                continue
            if copy is not None:
                self._revive(chunk)  # costs no memory and no copy
                continue
            if max_bytes is not None and started + chunk.nbytes > max_bytes:
                break
            mark = mark or self.compute_mark()  # one mark for every block allocated here
            self.queue_prefetch(chunk, self.new_block(chunk.nbytes), after=mark)
            started += chunk.nbytes
        if started:
            self.stats.prefetches += 1
            self.stats.gpu_bytes_freed = self.offloaded_bytes
        self.pump()
        return started

    def _revive(self, chunk: Chunk) -> None:
        """A chunk whose copy out is in flight comes back without a copy: the memory it is read from still
        holds it. The compute stream must let that copy finish reading before it writes there."""
        copy = chunk.copy
        self._point_at_sources(copy)
        chunk.ready, chunk.copy = copy.done, None
        self.leaving_bytes -= chunk.nbytes

    def _point_at_sources(self, copy: Copy) -> None:
        """Point a chunk going out at the GPU memory its copy reads: its block, and tensors of their own."""
        chunk, own = copy.chunk, iter(copy.keep)  # keep: the tensors of their own, in entry order
        for entry, in_block in zip(chunk.entries, copy.in_block, strict=True):
            entry.tensor.data = planning.view(copy.block, entry.offset, entry.tensor) if in_block else next(own)
            entry.in_block = in_block
        chunk.on_gpu, chunk.block = True, copy.block

    def hand_to_compute(self, chunk: Chunk) -> None:
        """Make the chunk usable by the compute stream: start its copy back if still queued, and order
        the compute stream after it on the device (timed: the copy time the step stood waiting)."""
        copy = chunk.copy
        if copy is not None and copy.direction == PREFETCH and copy.done is None:
            self.start(copy)
        elif copy is not None and copy.direction == OFFLOAD:
            if copy.done is None:
                self._cancel(copy)  # never started: the chunk is still here
            else:
                self._revive(chunk)
        if chunk.ready is not None:
            if chunk.ready.query():
                chunk.ready = None  # landed already: no wait on the device at all
            else:
                start, end = self.streams.compute_waits(chunk.ready)
                if self.streams.timed:
                    self.timings.add("exposed", self.step_index, start, end)
                chunk.ready = None
        chunk.touched = True

    def wait(self) -> None:
        """Make the whole state usable by the compute stream."""
        self.prefetch()
        for chunk in self.chunks:
            self.hand_to_compute(chunk)

    def check_gradients(self) -> None:
        """Refuse a gradient on another device than the GPU the step runs on, before anything moves:
        while offloaded, a param's ``.data`` is its host copy, so a gradient made from it lands on the
        CPU, and Adam would fail half-way with a device error."""
        if self.device is None or self.device.type != "cuda":
            return
        for chunk in self.chunks:
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
            for chunk in self.chunks:
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

    def host_copies_ready(self) -> None:
        """Block until every copy has landed, so CPU code can read offloaded state."""
        self.drain()

    def restore(self) -> None:
        """Bring everything back to the device for good, each tensor in storage of its own again, and
        free the host slab (used at detach)."""
        self.wait()
        for chunk in self.chunks:
            if chunk.block is not None:  # one chunk at a time, so this costs one chunk of extra memory
                for entry in chunk.entries:
                    entry.tensor.data = entry.tensor.data.clone()
                chunk.block = None
        self._release_slab()

    def read_stats(self) -> OffloadStats:
        """The totals so far, including every copy that has completed by now (no sync)."""
        self.timings.harvest(self.stats)
        if self.device is not None and self.device.type == "cuda":
            self.stats.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
            self.stats.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        return self.stats
