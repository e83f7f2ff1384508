"""The offloader's plan of the state and its host slab, re-made only for a new set of state tensors
(a checkpoint load), the slab only when too small: pinning is slow (0.5 s per GiB) and a new layout
needs every chunk back. Knows the copies only as ``wait()`` and ``copies.drain()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from megatron_offload.core.copies import CopyQueue
from megatron_offload.core.host_memory import HostSlab, check_host_room
from megatron_offload.core.stats import OffloadStats
from megatron_offload.core.units import GIB
from megatron_offload.optimizer_state import plan as planning
from megatron_offload.optimizer_state.plan import Chunk, Plan

logger = logging.getLogger(__name__)

__all__ = ["PlannedState"]


class PlannedState:
    """The plan, the host slab it lays the state out in, and what they say about the state."""

    optimizer: torch.optim.Optimizer
    master_weights: list[torch.Tensor]
    keep_state_keys: frozenset[str]
    chunk_bytes: int
    fraction: float
    kept_goal: int | None  # bytes to keep on the GPU as decided last (``keep_bytes``); None: by ``fraction``
    pin_memory: bool
    check_host_memory: bool
    stats: OffloadStats
    plan: Plan
    plan_dirty: bool
    kept_bytes: int
    _slab: HostSlab | None
    _warned_shared: set[int]
    wait: Callable[[], None]  # the offloader's: every chunk back and usable
    copies: CopyQueue

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
        self.copies.drain()  # no copy may still read or write the slab in the old layout
        cuts = planning.cut(self.optimizer, found, self.chunk_bytes)
        self._make_room(sum(expected for piece in cuts for _, _, expected in piece))
        sizes = [sum(expected for _, _, expected in piece) for piece in cuts]
        self.plan = planning.lay_out(cuts, self._slab.tensor, key, self._first_kept(sizes))
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
        """Offload at least this share of the state from now on: whole chunks at the back stay, within
        the rest (rounded down); chunks no longer kept leave at the next ``offload()``, newly kept ones
        come back through the next step and stay."""
        self.fraction, self.kept_goal = fraction, None
        self._mark_kept()

    def keep_bytes(self, nbytes: int) -> int:
        """Keep at most ``nbytes`` of the state on the GPU from now on, in this plan and later ones: the
        longest run of whole chunks at the back that fits (``plan.kept_from_bytes``); moves as
        ``set_fraction`` does. Returns the bytes kept, counting the moments Adam's first step will add."""
        self.kept_goal = nbytes
        self._mark_kept()
        return self.kept_bytes

    def full_sizes(self) -> list[int]:
        """Each chunk's size once Adam's first step has added the moments, in step order."""
        return [max(c.nbytes, c.expected) for c in self.chunks]

    def _first_kept(self, sizes: list[int]) -> int:
        """Index of the first kept chunk: by the bytes decided last, else by the fraction, in bytes."""
        goal = self.kept_goal
        if goal is None:
            goal = int((1.0 - self.fraction) * sum(sizes))
        return planning.kept_from_bytes(sizes, goal)

    def _mark_kept(self) -> None:
        first_kept = self._first_kept(self.full_sizes())
        for chunk in self.chunks:
            chunk.kept = chunk.index >= first_kept
        self.count_plan()

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
        self.copies.drain()  # a copy may still be reading or writing the old slab: idle before freeing it
        if self._slab is not None:
            self._slab.release()
        self.plan, self._slab = Plan(), None
        self.count_plan()

    def plan_is_current(self) -> bool:
        """Every offloadable tensor is in the plan (the moments Adam's first step made were adopted into
        their chunks); then the plan is the state's. One walk over the state."""
        found = list(self._offloadable())
        if self.plan_dirty or self._slab is None or not all(id(tensor) in self.plan.planned for tensor, _ in found):
            return False
        self.plan.key = planning.plan_key(found)
        return True
