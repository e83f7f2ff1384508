"""When state may come back during backward: the gradient-ready hooks of the last two micro-batches.

Installed on about ``pacing.SAMPLES`` params per backward; they know the handle and its scheduler only,
nothing of Megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_offload.core.gpu_memory import allocated_bytes, allocation_counters, read_memory
from megatron_offload.core.units import MIB
from megatron_offload.megatron.pacing import Handle, sampled

__all__ = ["BACK_EARLY_OVER_LEFT", "PrefetchDuringBackward", "growth_ahead"]

# Least room kept free beyond what the rest of the backward adds (see growth_ahead): the allocator rounds each
# request up, and state comes back in pieces of at most --offload-chunk-mb.
PACING_MIN_MARGIN_BYTES = 64 * MIB
# Allocator retries in one last backward that bringing state back there may cause (see PrefetchDuringBackward):
# one is cheap; several per backward, as under a cap that forces 90% of the state off, cost more than the
# step's copies in beside its copies out. RETRYING_BACKWARDS in a row stop it: a single spike does not.
RETRIES_TOLERATED = 1
RETRYING_BACKWARDS = 2
# What coming back in the last backward is worth, over the bytes the step leaves the next forward to carry out: the
# step's way out waits for its first update and stands still between updates while its way in runs from the backward's
# end, so the way in must carry less for the two to end together. Under caps forcing 75% and 90% of
# configs/gpt_0p9b.yaml's state off (one H200), with half the next forward's share back the way in carried state for
# 4-30 ms of that backward and the step waited for copies in; with 1.5 times the whole share, 53-55 ms, and the first
# forward, that backward and the step ran 21-30 ms shorter together on one machine. On another they summed 346-351 ms
# under the 90% cap, what the rule before this one summed on the first (339-355), and under a 50% cap as long as it.
BACK_EARLY_OVER_LEFT = 1.5


class PrefetchDuringBackward:
    """Brings state back during the last two micro-batches' backwards (gradient-ready hooks), only
    chunks whose copy out has landed (no hook waits), as far as the limit allows. In reserved bytes:
    - from the next-to-last backward, into the room the forward's natural peak leaves under the limit;
    - in the last backward also into what backward frees, less what the rest of that backward will add on
      top of the memory held at each hook (``growth_ahead``, learned from the first last backward read);
    - beyond what coming back early is worth (below), only into memory the allocator could still map under
      the limit (``scheduler.spare``): what backward frees stays mapped in blocks of its own sizes, which pieces
      coming back may not fit, and the next forward then finds the cap reached;
    - bounded at the step, whose own tensors (fp32 grads, Adam's temporaries, staging) come on top of
      what came back and of all kept state: what the step holds at its start without state is learned too.
    The first iteration that samples only learns.

    What does not come back early starts back once backward is done (``finalize_prefetch.bring_back_for_step``)
    or streams in the step, its copies in beside the step's copies out (the link carries both directions at
    once), so only the copies in beyond the step's copies out lengthen it: the bytes the step leaves to the
    next forward (``handle.left_to_forward()``) and what its way out loses waiting for updates
    (``BACK_EARLY_OVER_LEFT``). Bringing more back early is worth it only while it is free. Near the limit
    it is not: memory freed by backward is cached in blocks our chunks may not fit, so the caching allocator
    runs out of room and retries, and each retry synchronizes the device and unmaps its cache in the middle
    of the backward. Once ``RETRYING_BACKWARDS`` last backwards in a row brought state back and saw more than
    ``RETRIES_TOLERATED`` retries each, later ones bring back at most what coming back early is worth
    (``limited``; those bytes are read at each iteration's start, 0 until the first forward and the copies
    out were timed).
    NOTE: the last backward is counted, not read from DDP's ``is_last_microbatch``: Megatron-LM installs
    ``no_sync`` only with --overlap-grad-reduce, so without it that flag is always set.
    """

    def __init__(
        self, handle: Handle, model_chunks: Sequence[torch.nn.Module], in_last_microbatch: Callable[[], bool]
    ) -> None:
        self.handle = handle
        self.in_last_microbatch = in_last_microbatch
        self.brought = 0  # bytes brought back during this iteration
        self.readings: list[tuple[int, int]] = []  # learning: (held without state, bytes allocated so far) per hook
        self.ahead: list[int] | None = None  # growth_ahead per hook of the last backward; None until learned
        self.hook = 0  # hooks reached in this last backward
        self.at_step: int | None = None  # most memory held when a step starts, without optimizer state
        self.step_started = False
        self.step_extra = 0  # what the step adds on top (streamed_step.footprint)
        self.sampled = False  # the last backward was reached (its allocator retries read)
        self.moving = 0  # bytes that leave the GPU between steps (none: nothing comes back, the hooks only pump)
        self.smallest = 0  # the smallest chunk among them: less room than this brings nothing back
        self.limited = False  # retries were seen: bring back at most what coming back early is worth
        self.worth = 0  # bytes coming back early is worth (BACK_EARLY_OVER_LEFT, set in new_iteration)
        self.retries_before: int | None = None  # the allocator's retries as this last backward was first read
        self.retrying = 0  # last backwards in a row that brought state back and made the allocator retry
        self.stopped = False  # nothing more comes back in this last backward: a retry, or no room the allocator can map
        self.first_param: int | None = None  # id of the param whose gradient is ready first in a backward
        self.backwards = 0  # backwards begun in this iteration
        self.backwards_per_iteration: int | None = None
        params = list({id(p): p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad}.values())
        self.hooks = [param.register_post_accumulate_grad_hook(self.on_grad_ready) for param in sampled(params)]
        self.on_gpu = torch.cuda.is_available()

    def on_grad_ready(self, param: torch.Tensor) -> None:
        if self.handle.quiet:
            return  # nothing to pump or bring back; the backwards are counted once something moves
        if self.first_param is None:
            self.first_param = id(param)
        if id(param) == self.first_param:
            self.backwards += 1
        if not self.on_gpu:
            return
        self.handle.pump()
        per_iteration = self.backwards_per_iteration
        if not self.moving or per_iteration is None or self.backwards < per_iteration - 1:
            return
        last = self.backwards == per_iteration and self.in_last_microbatch()
        first = None  # the last backward's first reading, which its first hook's room reads too
        if last and not self.sampled:
            first = read_memory()
            self.retries_before, self.sampled = first.retries, True
        if last:
            self.hook += 1
            if self.ahead is None:  # learning: nothing comes back in this backward, every hook reads
                self.readings.append(self._natural())
                return
        bound = self.step_bound()
        if self.stopped or self.brought >= self.moving or (bound is not None and bound < self.smallest):
            # Nothing can come back before the step: no reading (each costs tens of microseconds of the
            # backward's host time, which the GPU waits for where the loop is host-bound).
            return
        if self.ahead is None or bound is None:
            return
        handle, scheduler = self.handle, self.handle.scheduler
        room = scheduler.room() - handle.kept_bytes() - handle.pending_offload_bytes() - self.brought
        if last:  # only the last backward reads memory: the next-to-last one's room is the forward's natural peak's
            reading = first or read_memory()
            if reading.retries > (self.retries_before or 0):
                self.stopped = True  # the allocator retried in this backward: its blocks are at the cap
                return
            ahead = self.ahead[min(self.hook, len(self.ahead)) - 1]  # learned with at least one hook
            room = max(room, scheduler.backward_room(reading.allocated + ahead))
            # Beyond what coming back early is worth, only what the allocator can map without a retry.
            mappable = max(self.worth - self.brought, scheduler.spare(reading.reserved) - PACING_MIN_MARGIN_BYTES)
            if mappable < self.smallest:
                # Neither grows again in this backward: what came back only grows, and with the allocator's
                # default max_split_size_mb and garbage_collection_threshold it unmaps only in a retry, which
                # stops it too (set, it may unmap sooner: what it frees then is left to the step, never lost).
                # The later hooks need not read memory.
                self.stopped = True
                return
            room = min(room, mappable)
        room = min(room, bound)
        # A call that could bring nothing back (room for no chunk) walks every chunk for naught, in the
        # backward's thread, at every hook.
        if room >= self.smallest:
            self.brought += handle.prefetch(max_bytes=room, landed_only=True)

    def step_bound(self) -> int | None:
        """Most bytes that may still come back before the step (None until the step was learned): at its start
        the step holds what it holds without state, its own buffers, all kept state (back already, or newly
        kept and coming back then) and what came back early; limited, at most what coming back early is worth."""
        if self.at_step is None:
            return None
        handle = self.handle
        bound = handle.scheduler.backward_room(self.at_step + self.step_extra + handle.kept_bytes()) - self.brought
        if self.limited:
            bound = min(bound, self.worth - self.brought)
        return bound

    def on_backward_done(self) -> None:
        """Called as the optimizer's step begins, before anything else comes back: whether bringing state
        back during the last backward made the allocator retry."""
        if self.retries_before is None:  # the last backward was not reached
            return
        if self.ahead is None and self.readings:
            # The last reading before the step: what the backward allocated after its last hook counts too.
            self.ahead = growth_ahead([*self.readings, self._natural()])
        retried = self.brought > 0 and read_memory().retries - self.retries_before > RETRIES_TOLERATED
        self.retrying = self.retrying + 1 if retried else 0
        self.limited = self.limited or self.retrying >= RETRYING_BACKWARDS
        self.retries_before = None

    def _natural(self) -> tuple[int, int]:
        """A learning reading: memory held without the copies out still pending (they free their blocks as they
        land, in the middle of this backward or not in a later one: no room the backward leaves), and the
        allocator's count of bytes ever allocated."""
        held, ever = allocation_counters()
        return held - self.handle.pending_offload_bytes(), ever

    def on_step_start(self) -> None:
        """Called as the inner optimizer step starts (gradients prepared): learn what the step holds."""
        if self.step_started or not self.on_gpu:
            return
        self.step_started = True
        # Without state: kept state is not there yet in the iteration after the decision, and is later.
        held = allocated_bytes() - self.handle.gpu_state_bytes()
        self.at_step = held if self.at_step is None else max(self.at_step, held)

    def new_iteration(self) -> None:
        """Called after every step: learn from the backward just seen, start afresh."""
        if self.backwards_per_iteration is None and self.backwards:
            self.backwards_per_iteration = self.backwards  # the next iteration samples its last backward
        self.sampled, self.brought, self.backwards, self.hook = False, 0, 0, 0
        self.readings = []
        self.step_started, self.retries_before, self.stopped = False, None, False
        self.step_extra = self.handle.step_footprint()
        self.worth = int(self.handle.left_to_forward() * BACK_EARLY_OVER_LEFT)
        sizes = self.handle.moving_chunks()
        self.moving, self.smallest = sum(sizes), max(1, min(sizes, default=0))

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def growth_ahead(readings: list[tuple[int, int]]) -> list[int]:
    """From one last backward's readings at each hook, and one as it ended (memory held, and the allocator's
    count of bytes ever allocated): for each hook, the most the backward may hold from there to its end, above
    what it held there. Between two readings it holds at most what it held at the first plus every byte it
    allocated in between (frees only lower that), so this bounds what no reading sees (a layer's temporaries)
    without resetting the process's peak statistics, which Megatron and users read. At least
    ``PACING_MIN_MARGIN_BYTES``."""
    highest = [held + after[1] - counted for (held, counted), after in zip(readings[:-1], readings[1:], strict=True)]
    ahead, most = [], 0
    for (held, _), high in zip(reversed(readings[:-1]), reversed(highest), strict=True):
        most = max(most, high)
        ahead.append(max(PACING_MIN_MARGIN_BYTES, most - held))
    return ahead[::-1]
