"""The offloader's plan of the state and its host slab, re-made only for a new set of state tensors
(a checkpoint load), the slab only when too small: pinning is slow (0.5 s per GiB) and a new layout
needs every chunk back. Knows the copies only as ``copies.drain()`` and the ``bring_back`` callable that
the offloader passes to a re-plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from megatron_offload.core.copies import CopyQueue
from megatron_offload.core.host_memory import HostSlab, check_host_room
from megatron_offload.core.stats import OffloadStats
from megatron_offload.core.units import GIB
from megatron_offload.optimizer_state import plan as planning
from megatron_offload.optimizer_state.plan import Chunk, Plan
from megatron_offload.optimizer_state.scheduler import kept_chunks

logger = logging.getLogger(__name__)

__all__ = ["PlannedState"]


class PlannedState:
    """The plan, the host slab it lays the state out in, and what they say about the state: the one owner
    of the plan, the slab, the kept-bytes goal and the kept bytes."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        master_weights: Sequence[torch.Tensor],
        keep_state_keys: Sequence[str],
        chunk_bytes: int,
        fraction: float,
        pin_memory: bool,
        check_host_memory: bool,
        stats: OffloadStats,
        copies: CopyQueue,
    ) -> None:
        self.optimizer = optimizer
        self.master_weights = list(master_weights)
        self.keep_state_keys = frozenset(keep_state_keys)
        self.chunk_bytes = chunk_bytes
        self.fraction = fraction
        self.kept_goal: int | None = None  # bytes to keep (keep_bytes, evict); None: by ``fraction``
        self.pin_memory = pin_memory
        self.check_host_memory = check_host_memory
        self.stats = stats  # the offloader's; this object writes its plan figures (host, kept, pinned)
        self.copies = copies  # the offloader's queue: drained before the slab is re-laid or freed
        self.plan = Plan()
        self.plan_dirty = True
        self.kept_bytes = 0  # state kept on the GPU, counting the moments to come (see count_plan)
        self.host_slab: HostSlab | None = None
        self._warned_shared: set[int] = set()
        self._walked: tuple | None = None  # (plan, identities) when a walk last found that plan current

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
        return self.host_slab.tensor

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

    def refresh(self, bring_back: Callable[[], None]) -> None:
        """Re-make the chunks (in the same slab when it is large enough) if the set of offloadable
        tensors changed. ``bring_back`` (the offloader's ``wait``) brings every chunk back first: a new
        plan starts from tensors on the GPU."""
        self.plan_dirty = False
        found = list(self._offloadable())
        key = planning.plan_key(found)
        if self.host_slab is not None and key == self.plan.key:
            return
        bring_back()
        self.copies.drain()  # no copy may still read or write the slab in the old layout
        cuts = planning.cut(self.optimizer, found, self.chunk_bytes)
        self._make_room(sum(expected for piece in cuts for _, _, expected in piece))
        sizes = [sum(expected for _, _, expected in piece) for piece in cuts]
        self.plan = planning.lay_out(cuts, self.host_slab.tensor, key, self._kept(sizes))
        self.count_plan()
        self.stats.pinned = self.host_slab.pinned or not self.chunks
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

    def prepare(self, bring_back: Callable[[], None]) -> None:
        """Plan the state and pin its host slab now (about 0.5 s per GiB), so that the first offload
        runs at link speed instead of pinning on the way. No copies are made."""
        if self.host_slab is None and not self.is_offloaded:
            self.refresh(bring_back)

    def set_fraction(self, fraction: float) -> None:
        """Offload at least this share of the state from now on: whole chunks from the back stay, within
        the rest (rounded down); chunks no longer kept leave at the next ``offload()``, newly kept ones
        come back through the next step and stay."""
        self.fraction, self.kept_goal = fraction, None
        self._mark_kept()

    def keep_bytes(self, nbytes: int) -> int:
        """Keep at most ``nbytes`` of the state on the GPU from now on, in this plan and later ones: the
        whole chunks from the back that fit (``scheduler.kept_chunks``); moves as
        ``set_fraction`` does. Returns the bytes kept, counting the moments Adam's first step will add."""
        self.kept_goal = nbytes
        self._mark_kept()
        return self.kept_bytes

    def let_go(self, nbytes: int) -> list[Chunk]:
        """Keep ``nbytes`` less on the GPU: the frontmost kept chunks are no longer kept
        until that many are let go, and what stays kept is the goal from now on, in later plans too.
        Returns the chunks let go (the offloader sends those on the GPU out)."""
        released, gone = 0, []
        for chunk in self.chunks:
            if released >= nbytes:
                break
            if chunk.kept:
                chunk.kept = False
                released += chunk.nbytes
                gone.append(chunk)
        self.count_plan()
        self.kept_goal = self.kept_bytes
        return gone

    def full_sizes(self) -> list[int]:
        """Each chunk's size once Adam's first step has added the moments, in step order."""
        return [max(c.nbytes, c.expected) for c in self.chunks]

    def _kept(self, sizes: list[int]) -> set[int]:
        """The kept chunks' indices: by the bytes decided last, else by the fraction, in bytes."""
        goal = self.kept_goal
        if goal is None:
            goal = int((1.0 - self.fraction) * sum(sizes))
        return kept_chunks(sizes, goal)

    def _mark_kept(self) -> None:
        kept = self._kept(self.full_sizes())
        for chunk in self.chunks:
            chunk.kept = chunk.index in kept
        self.count_plan()

    def _make_room(self, host_bytes: int) -> None:
        """Keep the host slab if it is large enough, else pin a new one of ``host_bytes``, which counts
        the moments Adam's first step will add, so that the slab is pinned only once."""
        if self.host_slab is not None and self.host_slab.nbytes >= host_bytes:
            return
        self.release_slab()
        if self.check_host_memory:
            # Other ranks on this node may have pinned theirs already: count only our own bytes here.
            check_host_room(host_bytes, ranks=1)
        self.host_slab = HostSlab(host_bytes, torch.uint8, self.pin_memory)

    def release_slab(self) -> None:
        """Free the host slab and forget the plan laid out in it."""
        self.copies.drain()  # a copy may still be reading or writing the old slab: idle before freeing it
        if self.host_slab is not None:
            self.host_slab.release()
        self.plan, self.host_slab = Plan(), None
        self.count_plan()

    def plan_is_current(self) -> bool:
        """Every offloadable tensor is in the plan (the moments Adam's first step made were adopted into
        their chunks); then the plan is the state's. One walk over the state, unless nothing it rests on has
        a new identity since a walk found this plan current (``_identities``)."""
        if self.plan_dirty or self.host_slab is None:
            return False
        identities = self._identities()
        walked = self._walked
        if walked is not None and walked[0] is self.plan and walked[1] == identities:
            return True
        found = list(self._offloadable())
        if not all(id(tensor) in self.plan.planned for tensor, _ in found):
            return False
        self.plan.key = planning.plan_key(found)
        self._walked = (self.plan, identities)
        return True

    def _identities(self) -> tuple:
        """What a walk's answer rests on, by identity: the state dict, the params in their groups, the values
        in their state (but the kept keys') and the loose masters. A new tensor (Adam's first step, one put in
        the state's place) has a new identity: the plan's entries hold every planned tensor, so none of theirs
        is reused. About a tenth of a walk's host time; the step and the offload after it check twice an iteration."""
        state, keep = self.optimizer.state, self.keep_state_keys
        return (
            id(state),
            [id(param) for group in self.optimizer.param_groups for param in group["params"]],
            [id(value) for values in state.values() for key, value in values.items() if key not in keep],
            [id(tensor) for tensor in self.master_weights],
        )

    def replaced(self) -> None:
        """The state's tensors may be new ones (a checkpoint load): the next offload plans afresh."""
        self.plan_dirty, self._walked = True, None  # a load is not trusted to identities
