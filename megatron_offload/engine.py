"""Move an optimizer's per-parameter state to host memory between steps, and back for the next one.

This module knows nothing of Megatron: it works on any ``torch.optim.Optimizer`` plus an optional
list of extra tensors (fp32 master weights kept outside the optimizer state). The plan (plan.py) cuts
the state into chunks of whole parameters; this class moves them: each chunk is offloaded (to host)
and prefetched (back to the GPU) on its own, through a copy lane per direction (copy_lane.py): a
helper thread that issues a chunk's copy once what it depends on has finished (waited for on the
host), and frees a chunk's GPU memory once its offload has landed. The streamed step is in
streamed_step.py; when to move what is decided by the scheduler (scheduler.py) through the handle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import torch

from megatron_offload import plan as planning
from megatron_offload import streamed_step
from megatron_offload.copy_lane import Completion, CopyJob, CopyLane, CopyLaneError
from megatron_offload.host_memory import HostSlab, check_host_room
from megatron_offload.plan import Chunk, Plan
from megatron_offload.stats import OffloadStats, Timings
from megatron_offload.units import GIB, MIB

logger = logging.getLogger(__name__)

__all__ = ["OptimizerStateOffloader"]

DEFAULT_CHUNK_BYTES = 64 * MIB
# Copies a lane keeps queued on its stream: one. Then a read queued behind them (a loss .item()) waits
# for one chunk at most, and a device-wide sync (Megatron's, at every logged iteration) finds the link
# idle between two chunks and returns. Measured on an H100 (benchmarks/copy_order_probe.py): a read right
# after a step that offloads 8.4 GB waited at most 1.1 ms with one, up to 24 ms with two.
LANE_DEPTH = 1
# The lanes' threads need the GIL to issue each chunk; Python hands it over every switch interval (5 ms by
# default). A shorter one (MEGATRON_OFFLOAD_GIL_SWITCH_S, seconds) lets a lane issue sooner but taxes every
# thread of the process: measured on an H100 in Megatron-LM's loop (results/2026-11-23-scheduler-h100),
# 0.5 ms cost 763 against 642 ms per iteration with nothing moving, and gained nothing with everything
# moving (886 against 870 ms). So the default leaves Python's interval alone.
GIL_SWITCH_SECONDS = float(os.environ.get("MEGATRON_OFFLOAD_GIL_SWITCH_S", "0")) or None


class OptimizerStateOffloader:
    """Keeps an optimizer's tensor state (and given master weights) in host memory between steps.

    Lifecycle per iteration: ``offload()`` after the step; ``prefetch()`` (all, or as many bytes as
    memory allows) while the next iteration computes; then either ``wait()`` and the optimizer's own
    step, or ``run_step()``, which streams whatever has not come back through a pipelined step.

    NOTE: tensor objects are never replaced, only what they hold: offloading points each one's ``.data``
    at its host copy at once (the GPU memory is then held only by the offload lane, which frees it when
    the copy has landed; ``pending_offload_bytes``, ``drain_offloads``) and prefetching points it at GPU
    memory. ``optimizer.state``, ``param_groups`` and outside references stay valid; while offloaded a
    tensor is a CPU tensor with the right values (after ``host_copies_ready()``), code that mixes it with
    GPU tensors gets a device error, and a write to it (a checkpoint load) lands in the host copy that the
    next prefetch brings back.
    NOTE: the set of tensors is looked up again at every ``offload()``. The moments Adam creates at its
    first step join their param's chunk (the slab was sized for them); a state-dict load that replaces
    tensors makes a new plan, in the same slab when it fits. The slab is pinned once in training.
    NOTE: kept chunks (``fraction`` below 1, or what the scheduler chose for ``auto``) are planned into
    the slab too, so that they can be offloaded at once should memory run short, and stay on the GPU.
    NOTE: a chunk that came back but was never handed to the compute stream (a skipped step) is not
    copied again: its host copy is still exact, so its GPU memory is simply dropped.
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
        self.plan = Plan()
        self.kept_bytes = 0  # state kept on the GPU, counting the moments to come (see _count_plan)
        self._slab: HostSlab | None = None
        self._warned_shared: set[int] = set()
        params = planning.all_params(optimizer)
        self._device: torch.device | None = params[0].device if params else None
        self._offload_lane: CopyLane | None = None
        self._prefetch_lane: CopyLane | None = None
        self._offload_stream: torch.cuda.Stream | None = None  # None without CUDA: lanes copy synchronously
        self._prefetch_stream: torch.cuda.Stream | None = None
        # The stream training runs on, fixed at attach: hooks on autograd's thread allocate on it too,
        # so state blocks come from the pool activations use and free into.
        self._compute: torch.cuda.Stream | None = torch.cuda.current_stream(self._device) if self._on_cuda else None
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self.step_index = 0
        self.timings = Timings()
        if check_host_memory:
            check_host_room(self.estimated_host_bytes())

    # ----------------------------------------------------------------------------------- state
    @property
    def _chunks(self) -> list[Chunk]:
        return self.plan.chunks

    @property
    def is_offloaded(self) -> bool:
        """True while any chunk of the state is in host memory only."""
        return any(chunk.offloaded for chunk in self._chunks)

    @property
    def offloaded_bytes(self) -> int:
        return sum(chunk.nbytes for chunk in self._chunks if chunk.offloaded)

    @property
    def on_gpu_bytes(self) -> int:
        """State on the GPU now: kept, brought back, or still held by an offload under way."""
        return sum(chunk.nbytes for chunk in self._chunks if not chunk.offloaded) + self.pending_offload_bytes

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

    def _current_key(self) -> tuple:
        return planning.plan_key(list(self._offloadable()))

    def _refresh_plan(self) -> None:
        """Re-make the chunks (in the same slab when it is large enough) if the set of offloadable
        tensors changed. Needs every chunk on the GPU (the caller waits first)."""
        found = list(self._offloadable())
        key = planning.plan_key(found)
        if self._slab is not None and key == self.plan.key:
            return
        cuts = planning.cut(self.optimizer, found, self.chunk_bytes)
        self._make_room(sum(expected for piece in cuts for _, _, expected in piece))
        sizes = [sum(expected for _, _, expected in piece) for piece in cuts]
        self.plan = planning.lay_out(cuts, self._slab.tensor, key, planning.kept_from(sizes, self.fraction))
        self._count_plan()
        self.stats.pinned = self._slab.pinned or not self.plan.chunks
        if found:
            logger.info(
                "offload plan: %d tensors in %d chunks, %.3f GiB offloaded, %.3f GiB kept on the GPU",
                len(found),
                len(self._chunks),
                self.stats.offloaded_bytes / GIB,
                self.stats.kept_bytes / GIB,
            )

    def _count_plan(self) -> None:
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
        if not self._chunks:
            return
        first_kept = planning.kept_from([max(c.nbytes, c.expected) for c in self._chunks], fraction)
        for chunk in self._chunks:
            chunk.kept = chunk.index >= first_kept
        self._count_plan()

    def evict(self, nbytes: int) -> int:
        """Offload kept chunks on the GPU, from the front, until ``nbytes`` are under way (memory ran
        short); they stay offloaded. Returns the bytes handed to the offload lane."""
        started = 0
        for chunk in self._chunks:
            if started >= nbytes:
                break
            if chunk.kept and not chunk.offloaded:
                chunk.kept = False
                self._offload_chunk(chunk)
                started += chunk.nbytes
        self._count_plan()
        return started

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
        for lane in (self._offload_lane, self._prefetch_lane):
            if lane is not None:
                lane.drain()

    def _release_slab(self) -> None:
        self._finish_copies()  # a copy may still be reading or writing the old slab: idle before freeing it
        if self._slab is not None:
            self._slab.release()
        self.plan, self._slab = Plan(), None
        self._count_plan()

    # ------------------------------------------------------------------------------- the lanes
    @property
    def _on_cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def _lanes(self) -> tuple[CopyLane, CopyLane]:
        """The offload and prefetch lanes, each with a side stream of its own (made on first use)."""
        if self._offload_lane is None:
            device, on_cuda = self._device, self._on_cuda

            def setup() -> None:
                if on_cuda:
                    torch.cuda.set_device(device)  # the lane's thread issues copies for this device

            self._offload_lane = CopyLane("megatron-offload-offload", setup, max_in_flight=LANE_DEPTH)
            self._prefetch_lane = CopyLane("megatron-offload-prefetch", setup, max_in_flight=LANE_DEPTH)
            if on_cuda:
                self._offload_stream, self._prefetch_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
                if GIL_SWITCH_SECONDS and sys.getswitchinterval() > GIL_SWITCH_SECONDS:
                    logger.info(
                        "megatron-offload: GIL switch interval set to %g s for the copy lanes", GIL_SWITCH_SECONDS
                    )
                    sys.setswitchinterval(GIL_SWITCH_SECONDS)
        return self._offload_lane, self._prefetch_lane

    def compute_reached(self) -> torch.cuda.Event | None:
        """An event at the compute stream's current end: what a lane waits for (on the host) before its
        copy may read or overwrite memory the compute stream used."""
        if not self._on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._compute)
        return event

    def new_block(self, nbytes: int) -> torch.Tensor:
        """Device memory for state, from the compute stream's pool (also when called on autograd's thread)."""
        with torch.cuda.stream(self._compute) if self._on_cuda else contextlib.nullcontext():
            try:
                return torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            except torch.OutOfMemoryError as error:
                raise torch.OutOfMemoryError(
                    f"megatron-offload: not enough GPU memory to bring back {nbytes / MIB:.0f} MiB of "
                    "optimizer state; the state is still whole in host memory. Use --offload-prefetch step (the "
                    "step streams the state through three chunks), lower --offload-chunk-mb, or reduce the "
                    f"micro-batch size. ({error})"
                ) from error

    def _issuer(self, kind: str, stream: torch.cuda.Stream | None, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        """What a lane's thread calls to queue ``copies`` (destination, source) on ``stream``."""
        timing = self.timings.add(kind, self.step_index) if stream is not None else None

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
    def _offload_chunk(self, chunk: Chunk, urgent: bool = False) -> None:
        """Hand a chunk on the GPU to the offload lane, which copies it to host memory (if the compute
        stream may have changed it) and then frees its GPU memory; its tensors point at the host copy
        from now on."""
        lane, _ = self._lanes()
        copies, keep = [], []
        if chunk.gpu is not None:
            keep.append(chunk.gpu)
        slab = self._slab.tensor
        for host, offset, size in planning.runs([e for e in chunk.entries if e.in_block and chunk.gpu is not None]):
            copies.append((slab[host : host + size], chunk.gpu[offset : offset + size]))
        chunk.own_storage = [not (entry.in_block and chunk.gpu is not None) for entry in chunk.entries]
        for entry, own in zip(chunk.entries, chunk.own_storage, strict=True):
            if own:  # in storage of its own (made by the optimizer): kept alive by the job until copied
                keep.append(entry.tensor.data)
                copies.append((entry.host, entry.tensor.data))
        if chunk.touched:
            ready = self.compute_reached()  # the lane waits (on the host) for the compute stream's last write
            self.stats.bytes_offloaded += chunk.nbytes
        else:
            # Unchanged since it came back (a skipped step): the host copy is exact, nothing to copy; the
            # memory is freed once the prefetch that filled it has landed.
            copies, ready = [], chunk.prefetching
        issue = self._issuer("offload", self._offload_stream, copies) if copies else lambda: None
        label = f"{chunk.label(len(self._chunks))}, GPU to host"
        chunk.offloading = lane.submit(CopyJob(issue, chunk.nbytes, ready, keep, urgent, label=label))
        for entry in chunk.entries:
            entry.tensor.data = entry.host  # our reference to the device memory is now only the job's
            entry.in_block = True  # the next prefetch puts it in the chunk's block
        chunk.gpu, chunk.prefetching, chunk.touched, chunk.offloaded = None, None, False, True

    def _prefetch_chunk(
        self, chunk: Chunk, block: torch.Tensor | None = None, ready: Completion | None = None, urgent: bool = False
    ) -> None:
        """Hand an offloaded chunk to the prefetch lane, to come back into ``block`` (default: a new block
        from the compute stream's pool) once ``ready`` has completed."""
        _, lane = self._lanes()
        self.offload_landed(chunk)  # on the host: its host copy must be whole before it is read
        if block is None:
            block = self.new_block(chunk.nbytes)
            # The allocator may have handed us memory compute work has just freed: the lane waits (on the
            # host) for the compute stream to get past that work before overwriting it.
            ready = ready or self.compute_reached()
        slab = self._slab.tensor
        copies = [
            (block[offset : offset + size], slab[host : host + size])
            for host, offset, size in planning.runs(chunk.entries)
        ]
        issue = self._issuer("prefetch", self._prefetch_stream, copies)
        label = f"{chunk.label(len(self._chunks))}, host to GPU"
        chunk.prefetching = lane.submit(CopyJob(issue, 0, ready, urgent=urgent, label=label))
        for entry in chunk.entries:
            entry.tensor.data = planning.view(block, entry.offset, entry.tensor)
        chunk.gpu, chunk.offloaded = block, False
        self.stats.bytes_prefetched += chunk.nbytes

    def hand_to_compute(self, chunk: Chunk) -> None:
        """Order the compute stream after the chunk's prefetch, timing how long it stands waiting."""
        if chunk.prefetching is not None:
            if not self._on_cuda:
                chunk.prefetching.synchronize()
            else:
                # The copy must be queued before the compute stream can wait for it; it is then ahead of
                # the wait in every hardware queue, so the wait can always proceed.
                try:
                    landed = chunk.prefetching.wait_issued()
                except CopyLaneError:
                    # Nothing was ordered after the copy: the host copy is still whole, point back at it.
                    for entry in chunk.entries:
                        entry.tensor.data = entry.host
                    chunk.gpu, chunk.prefetching, chunk.offloaded = None, None, True
                    self._close_lanes(timeout=10.0)
                    raise
                timing = self.timings.add("exposed", self.step_index)
                timing.record_start(self._compute)
                self._compute.wait_event(landed)  # on the device: the host goes on queueing the step
                timing.record_end(self._compute)
            chunk.prefetching = None
        chunk.touched = True

    # -------------------------------------------------------------------------------- transfers
    @torch.no_grad()
    def offload(self) -> None:
        """Hand every chunk on the GPU that is not kept to the offload lane."""
        if self._slab is None or self.plan.key != self._current_key():
            self.wait()  # chunks still coming back must land before the plan can change
            self._refresh_plan()
        leaving = [chunk for chunk in self._chunks if not chunk.offloaded and not chunk.kept]
        for chunk in leaving:
            self._offload_chunk(chunk)
        if leaving:
            self.count_step()

    def count_step(self) -> None:
        if not self.stats.host_bytes:
            return  # nothing to move yet (Adam state not created, masters kept)
        self.stats.offloads += 1
        self.stats.gpu_bytes_freed = self.offloaded_bytes
        self.step_index += 1
        self.timings.harvest(self.stats)

    @torch.no_grad()
    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False) -> int:
        """Start bringing offloaded chunks back, in step order, up to ``max_bytes`` (default: all); with
        ``landed_only``, only chunks whose offload has landed, so the caller never waits (backward hooks).
        Returns at once with the bytes started; ``wait()`` or ``run_step()`` order the compute stream."""
        started = 0
        reached = None  # one mark for every block allocated here: no compute work is queued in between
        for chunk in self._chunks:
            if not chunk.offloaded:
                continue
            if max_bytes is not None and started + chunk.nbytes > max_bytes:
                break
            if landed_only and chunk.offloading is not None and not chunk.offloading.done.is_set():
                continue
            reached = reached or self.compute_reached()  # only when a chunk does start (hooks call this often)
            self._prefetch_chunk(chunk, ready=reached)
            started += chunk.nbytes
        if started:
            self.stats.prefetches += 1
            self.stats.gpu_bytes_freed = self.offloaded_bytes
        return started

    def wait(self) -> None:
        """Make the whole state usable by the compute stream: prefetch what is still offloaded, then
        order the compute stream after every copy."""
        self.prefetch()
        for chunk in self._chunks:
            self.hand_to_compute(chunk)

    @property
    def pending_offload_bytes(self) -> int:
        """GPU bytes of chunks handed to the offload lane and not freed yet."""
        return self._offload_lane.pending_bytes if self._offload_lane is not None else 0

    def drain_offloads(self, nbytes: int | None = None) -> int:
        """Block until offloads have freed at least ``nbytes`` of GPU memory (default: all), oldest
        first. Returns the bytes freed."""
        return self._offload_lane.drain(nbytes) if self._offload_lane is not None else 0

    def run_step(self, after_chunk: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """The optimizer step, streamed chunk by chunk; see streamed_step.py."""
        streamed_step.run_streamed_step(self, after_chunk)

    def check_gradients(self) -> None:
        """Refuse a gradient on another device than the GPU the step runs on, before anything moves:
        while offloaded, a param's ``.data`` is its host copy, so a gradient made from it lands on the
        CPU, and Adam would fail half-way with a device error."""
        if not self._on_cuda:
            return
        for chunk in self._chunks:
            for param in chunk.params:
                grad = param.grad
                if grad is not None and grad.device != self._device:
                    raise ValueError(
                        f"megatron-offload: a parameter's gradient is on {grad.device} but its optimizer step "
                        f"runs on {self._device} (shape {tuple(param.shape)}): while offloaded, a param's .data "
                        "is its host copy; make gradients on the GPU (e.g. torch.randn(shape, device='cuda'))"
                    )

    def step_footprint(self) -> int:
        """Most device memory the streamed step adds beyond what is on the GPU already."""
        return streamed_step.footprint(self)

    @contextlib.contextmanager
    def params_on_device(self) -> Iterator[None]:
        """While inside, offloaded params (master weights) look like device tensors of the right shape
        (no memory behind them), so code that assigns their ``.grad`` before the step works; their values
        stay in host memory, and the step brings them back chunk by chunk."""
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
        """Block the host until every offload has landed (and freed its GPU memory), so CPU code can read
        offloaded state."""
        for chunk in self._chunks:
            if chunk.offloaded:
                self.offload_landed(chunk)

    def offload_landed(self, chunk: Chunk) -> None:
        """Block until the chunk's offload has landed. If it failed, its GPU memory was kept (the lane never
        frees a failed job's memory): the chunk's tensors point at it again, so none points at a host copy
        that did not arrive, and the error is raised."""
        job, chunk.offloading = chunk.offloading, None
        if job is None:
            return
        try:
            job.synchronize()
        except CopyLaneError:
            kept = list(job.keep)  # [the chunk's block, if it had one] + own-storage tensors in entry order
            block = kept.pop(0) if len(kept) > sum(chunk.own_storage) else None
            own = iter(kept)
            for entry, in_own in zip(chunk.entries, chunk.own_storage, strict=True):
                entry.tensor.data = next(own) if in_own else planning.view(block, entry.offset, entry.tensor)
                entry.in_block = not in_own
            chunk.gpu, chunk.offloaded, chunk.touched = block, False, True
            self._close_lanes(timeout=10.0)
            raise

    def check_lanes(self) -> None:
        """Raise a lane's first failure now (a failed offload nobody waited for), before anything comes back."""
        for lane in (self._offload_lane, self._prefetch_lane):
            if lane is not None:
                lane.check()

    def _close_lanes(self, timeout: float | None = None) -> None:
        """Stop the lanes (bounded: a lane stuck on a copy that never completes is left with a message); new
        ones are made on the next copy."""
        for lane in (self._offload_lane, self._prefetch_lane):
            if lane is not None:
                lane.close(timeout=timeout)
        self._offload_lane = self._prefetch_lane = None

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
        self._close_lanes(timeout=60.0)

    def read_stats(self) -> OffloadStats:
        """The totals so far, including every copy that has completed by now (no sync)."""
        self.timings.harvest(self.stats)
        if self._on_cuda:
            self.stats.peak_allocated_bytes = torch.cuda.max_memory_allocated(self._device)
            self.stats.peak_reserved_bytes = torch.cuda.max_memory_reserved(self._device)
        return self.stats
