"""Move an optimizer's per-parameter state to host memory between steps, and back for the next one.

Knows nothing of Megatron: any ``torch.optim.Optimizer`` plus optional fp32 master weights. The offloader composes three
parts and owns the copy queue and the figures they share: ``state`` (planned_state.py: the plan of plan.py, which cuts
the state into chunks of whole parameters, with its host slab and the kept bytes), ``mover`` (chunk_copies.py: what a
chunk's copy through the copy core, core/copies.py, means for its tensors) and ``device_view`` (device_view.py: the
tensors as the step's code meets them on the device). Its prefetch walks the plan with prefetch_walk.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_offload.core.copies import CopyQueue
from megatron_offload.core.host_memory import check_host_room
from megatron_offload.core.stats import OffloadStats, Timings
from megatron_offload.core.streams import PREFETCH, Event, Streams, streams_for
from megatron_offload.core.units import MIB
from megatron_offload.optimizer_state import plan as planning
from megatron_offload.optimizer_state.chunk_copies import ChunkCopies, ChunkCopy, OffloadCopyError
from megatron_offload.optimizer_state.device_view import DeviceView
from megatron_offload.optimizer_state.plan import Chunk, Plan
from megatron_offload.optimizer_state.planned_state import PlannedState
from megatron_offload.optimizer_state.prefetch_walk import queue_back

__all__ = ["OffloadCopyError", "OptimizerStateOffloader"]

DEFAULT_CHUNK_BYTES = 64 * MIB


class OptimizerStateOffloader:
    """Keeps an optimizer's tensor state (and given master weights) in host memory between steps.

    Lifecycle per iteration: ``offload(now=False)`` queues the state out after the step;
    ``copies.pump()`` at the training loop's points moves it; ``prefetch(max_bytes)`` queues it back as
    memory allows; ``streamed_step.run`` steps chunk by chunk, streaming whatever is not back yet.

    NOTE: tensor objects are never replaced, only what they hold; a host copy is whole once its copy
    has landed (``copies.drain()`` before reading it on the CPU).
    NOTE: a tensor the plan does not hold, or ``state.replaced()`` (after a checkpoint load), makes a new plan;
    Adam's moments, made at its first step, join their param's chunk (the slab was sized for them).
    NOTE: kept chunks are planned into the slab too, so they can leave at once should memory run short.
    NOTE: a chunk that came back but was never handed to the compute stream is not copied again.
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
        if not chunk_bytes > 0:
            raise ValueError(f"OptimizerStateOffloader: chunk_bytes must be positive, got {chunk_bytes}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"OptimizerStateOffloader: fraction must be from 0 to 1, got {fraction}")
        self.stats = OffloadStats()
        self.timings = Timings()
        params = planning.all_params(optimizer)
        self.device: torch.device | None = params[0].device if params else None
        self.streams = streams or streams_for(self.device)
        self.copies = CopyQueue(self.streams)
        self.state = PlannedState(
            optimizer, master_weights, keep_state_keys, chunk_bytes, fraction, pin_memory, check_host_memory,
            self.stats, self.copies,
        )  # fmt: skip
        self.mover = ChunkCopies(self.state, self.stats, self.timings, self.streams, self.copies)
        self.device_view = DeviceView(self.device, self.state)
        if check_host_memory:
            check_host_room(self.state.estimated_host_bytes())

    # ------------------------------------------------------- what the plan and the copies say, as read
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def keep_state_keys(self) -> frozenset[str]:
        return self.state.keep_state_keys

    @property
    def chunk_bytes(self) -> int:
        return self.state.chunk_bytes

    @property
    def plan(self) -> Plan:
        return self.state.plan

    @property
    def chunks(self) -> list[Chunk]:
        return self.state.chunks

    @property
    def slab(self) -> torch.Tensor:
        return self.state.slab

    @property
    def is_offloaded(self) -> bool:
        return self.state.is_offloaded

    @property
    def offloaded_bytes(self) -> int:
        return self.state.offloaded_bytes

    @property
    def kept_bytes(self) -> int:
        return self.state.kept_bytes

    @property
    def leaving_bytes(self) -> int:
        return self.mover.leaving_bytes

    @property
    def gpu_state_bytes(self) -> int:
        return self.mover.holding_bytes()

    @property
    def kept_to_come_back(self) -> int:  # the step brings it back into blocks of its own
        return self.mover.kept_to_come_back()

    # ------------------------------------------------- the plan's and the copies' own operations
    def plan_is_current(self) -> bool:
        return self.state.plan_is_current()

    def count_plan(self) -> None:
        self.state.count_plan()

    def full_sizes(self) -> list[int]:
        return self.state.full_sizes()

    def set_fraction(self, fraction: float) -> None:
        self.state.set_fraction(fraction)

    def keep_bytes(self, nbytes: int) -> int:
        return self.state.keep_bytes(nbytes)

    def estimated_host_bytes(self) -> int:
        return self.state.estimated_host_bytes()

    def prepare(self) -> None:
        self.state.prepare(self.wait)

    def new_block(self, nbytes: int) -> torch.Tensor:
        return self.mover.new_block(nbytes)

    def queue_offload(self, chunk: Chunk, now: bool = False) -> ChunkCopy | None:
        self.plan.back_until = 0  # the chunk leaves: prefetch's next walk starts from the first chunk
        return self.mover.queue_offload(chunk, now)

    def queue_prefetch(self, chunk: Chunk, block: torch.Tensor | None = None, after: Event | None = None) -> ChunkCopy:
        return self.mover.queue_prefetch(chunk, block, after)

    def hand_to_compute(self, chunk: Chunk) -> None:
        self.mover.hand_to_compute(chunk)

    # ----------------------------------------------------------------------- whole-state moves
    def evict(self, nbytes: int) -> int:
        """Keep ``nbytes`` less on the GPU (memory ran short): kept chunks from the front of the kept run
        leave now (those on the GPU are queued out) until that many are no longer kept. What stays kept is
        the goal from now on, in later plans too, so nothing brings them back. Returns the bytes let go."""
        gone = self.state.let_go(nbytes)
        for chunk in gone:
            if chunk.on_gpu:
                self.queue_offload(chunk)
        self.copies.flush()
        return sum(chunk.nbytes for chunk in gone)

    @torch.no_grad()
    def offload(self, now: bool = True, kept_too: bool = False) -> None:
        """Queue every chunk on the GPU that is not kept to leave; ``now``: start every copy at once
        (``False``: the training loop's points start them, a few at a time); ``kept_too``: kept chunks
        leave as well and stay kept (a sleep: the next step brings them back). A new set of state
        tensors (a load replaced them) gets a new plan first."""
        if not self.state.plan_is_current():
            self.state.refresh(self.wait)
        queued = self.queue_out(kept_too)
        if now:
            self.copies.flush()
        if queued:
            self.count_step()

    def queue_out(self, kept_too: bool = False) -> bool:
        """Queue every chunk on the GPU that is not kept (``kept_too``: every chunk) and not leaving yet,
        on the plan as it stands (copies back that never started are dropped: those chunks stay on the
        host). True if any was."""
        self.plan.back_until = 0  # chunks whose copy back is dropped below stay on the host
        for copy in self.copies.queued(PREFETCH):
            if kept_too or not copy.chunk.kept:
                self.mover.cancel(copy)
        going = [chunk for chunk in self.chunks if kept_too or not chunk.kept]
        leaving = [chunk for chunk in going if chunk.on_gpu and not self.mover.leaving(chunk)]
        for chunk in leaving:
            self.queue_offload(chunk)
        return bool(leaving)

    def count_step(self) -> None:
        if not self.stats.host_bytes or all(chunk.kept for chunk in self.chunks):
            return  # nothing moves (no state yet, masters kept, or all of it kept)
        self.stats.offloads += 1
        self.stats.gpu_bytes_freed = sum(chunk.nbytes for chunk in self.chunks if not chunk.kept)  # out, or leaving
        self.mover.next_step()
        self.timings.harvest(self.stats)

    @torch.no_grad()
    def prefetch(self, max_bytes: int | None = None, landed_only: bool = False, now: bool = False) -> int:
        """Queue offloaded chunks back, in step order, up to ``max_bytes`` (default: all), and start what may start.
        A chunk whose copy out has not started yet simply stays. With ``landed_only``, only chunks whose copy out has
        landed (the backward's hooks); ``now``: each copy starts as it is queued (the link busy from the first)."""
        self.copies.retire_landed()  # a chunk whose copy out has landed is on the host, not leaving
        started = queue_back(self.plan, self.mover, self.streams, max_bytes, landed_only, now)
        if started:
            self.stats.prefetches += 1
            self.stats.gpu_bytes_freed = self.offloaded_bytes
        self.copies.pump()
        return started

    def wait(self) -> None:
        """Make the whole state usable by the compute stream."""
        self.prefetch()
        for chunk in self.chunks:
            self.mover.hand_to_compute(chunk)

    def restore(self) -> None:
        """Bring everything back to the device for good, each tensor in storage of its own again, and
        free the host slab (used at detach)."""
        self.wait()
        self.device_view.own_storage()
        self.state.release_slab()

    def read_stats(self) -> OffloadStats:
        """The totals so far, including every copy that has completed by now (no sync)."""
        self.timings.harvest(self.stats)
        if self.device is not None and self.device.type == "cuda":
            self.stats.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
            self.stats.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        return self.stats
