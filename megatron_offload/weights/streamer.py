"""Stream a model's layers through a few GPU slots: weights in before each use, gradients out after each
backward, the GPU holding only the layers being computed and the next ones.

Between uses a parameter's ``.data`` and gradient attribute (``main_grad`` in megatron-core) point at its host copy;
the unit is *lent* to the GPU around a use: its weights copied into a slot (prefetched while earlier layers
computed) and its params pointed there; in its backward, its gradients point into a gradient slot that starts at
zero (first micro-batch of a step) or at the host's running sum (later micro-batches), so the framework's own
accumulation (``main_grad.add_(grad)``) runs on the GPU and the result goes back to the host whole. The copies run
on the copy core's side streams; the compute stream waits for them on the device only; the host never waits.

NOTE: every copy in waits for a mark of the compute stream taken when it is queued: everything that
last read the slot and every write to the host copy (the optimizer step) is ordered before it.
NOTE: a gradient slot is reused only after its copy to host landed; the side stream that copies out
runs in order, so its latest event stands for every earlier copy out (``last_out``).
NOTE: ``settle()`` ends a step's streaming: every gradient on the host, the compute stream ordered after
the last copy out (the optimizer reads those gradients there), every slot forgotten (the step rewrites
the host weights), every parameter pointing at its host copy again, as the framework left it.
NOTE: the framework's zeroing of the host gradients may be skipped (``skip_zeroing()``): each unit's
first copy out of a step writes every element of its host ranges from a slot that started at zero,
and nothing reads them before; a unit whose gradients never left in a step is zeroed at ``settle()``.
NOTE: with ``norms``, each unit's per-tensor gradient norms are taken in its slot when its gradients
leave after the last micro-batch (``last_microbatch()``), before the copy out is ordered.
NOTE: layer-major backward (layer_major.py): while ``again`` is set a backward's end keeps the layer lent and
its slot summing; forwards wrap to the next micro-batch's first layer while ``forward_again()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_offload.core.streams import OFFLOAD, PREFETCH, Event, Streams
from megatron_offload.weights.grad_norms import SlotNorms
from megatron_offload.weights.plan import Schedule, Unit
from megatron_offload.weights.slots import Slot, SlotRing
from megatron_offload.weights.stats import WeightStats

__all__ = ["PREFETCH_AHEAD", "WeightStreamer"]

PREFETCH_AHEAD = 2  # layers whose weights are on their way while one computes


class WeightStreamer:
    """Lends ``layers`` (in use order) to the GPU through ``weight_slots`` + ``grad_slots`` buffers, and
    ``resident`` from its first use in a step until ``settle()``."""

    def __init__(
        self,
        layers: list[Unit],
        resident: Unit | None,
        streams: Streams,
        *,
        weight_slots: int = 3,
        grad_slots: int = 3,
        grad_attr: str = "main_grad",
        norms: SlotNorms | None = None,
        last_microbatch: Callable[[], bool] = lambda: True,
        forward_again: Callable[[], bool] = lambda: False,
    ) -> None:
        if weight_slots < 2 or grad_slots < 2:
            raise ValueError("weight streaming needs at least two weight slots and two gradient slots")
        self.layers, self.resident, self.streams, self.grad_attr = layers, resident, streams, grad_attr
        self.units = layers + ([resident] if resident is not None else [])
        self.norms, self.last_microbatch, self.forward_again = norms, last_microbatch, forward_again
        self.schedule = Schedule(len(layers))
        numel = max(unit.numel for unit in layers)
        self.weights = SlotRing(weight_slots, numel, layers[0].weights_dtype, streams.block)
        self.grads = SlotRing(grad_slots, numel, layers[0].grads_dtype, streams.block)
        # Uses ahead whose weights are fetched. More slots than that keep layers between micro-batches (the slot
        # whose layer is needed last goes first), which saves their copies rather than fetching further ahead.
        self.depth = min(weight_slots - 1, PREFETCH_AHEAD)
        dtypes = (resident.weights_dtype, resident.grads_dtype) if resident is not None else ()
        rings = [SlotRing(1, resident.numel, dtype, streams.block) for dtype in dtypes]
        self.resident_slots: tuple[Slot, Slot] | None = (rings[0].slots[0], rings[1].slots[0]) if rings else None
        self.now = 0  # the schedule position of the use in progress
        self.last_out: Event | None = None  # the latest copy to host queued
        self.backward_ran = False  # a backward ran since the last settle
        self.uses = 0  # streamed-layer uses so far (forwards and recomputes)
        self.forwards = 0  # forwards of the first streamed layer since the step began (micro-batches begun)
        self.again = False  # set by layer-major backward: the next backward is of the same layer
        self.stats = WeightStats(gpu_bytes=self.weights.nbytes + self.grads.nbytes + sum(r.nbytes for r in rings))

    # ------------------------------------------------------------------------ the loop's points
    def before_forward(self, index: int, backward: bool, layer_input: torch.Tensor | None = None) -> None:
        """A streamed layer is about to run: its forward (``backward`` False) or its recompute in backward."""
        unit = self.layers[index]
        self.uses += 1
        self.now = self.schedule.position(index, backward)
        if not backward:
            self.forwards += index == 0
            self.schedule.forward_again = self.forward_again()
        self._lend(unit, self._slot_with_weights(unit), grads=False)
        if backward:
            self.backward_ran = True
            self._lend(unit, self._slot_with_grads(unit), grads=True)
        elif layer_input is not None and layer_input.requires_grad:
            # The gradient of the layer's input is made when its (recompute and) backward has returned,
            # every weight gradient of the layer accumulated: the moment its gradients may leave.
            layer_input.register_hook(lambda _grad, index=index: self.after_backward(index))
        self._prefetch()

    def after_forward(self, index: int, backward: bool) -> None:
        """A streamed layer's forward returned; without grad its weights are not needed any more."""
        if not backward:
            self._give_back(self.layers[index])

    def after_backward(self, index: int) -> None:
        """A streamed layer's backward is done: its gradients go to the host, its slots free up."""
        unit = self.layers[index]
        if self.again:  # another micro-batch's backward of this layer follows: it stays, its sum too
            unit.summing = True
            return
        self._gradients_out(unit, unit.grads_in, final=self.last_microbatch())
        self._give_back(unit)
        self._prefetch()

    def lend_resident(self) -> None:
        """The resident unit comes to the GPU once per step, at its first use, and stays until settle."""
        unit = self.resident
        if unit is None or unit.lent:
            return
        weights, grads = self.resident_slots
        _, weights.ready = self.streams.copy(PREFETCH, unit.weight_pairs(weights.buffer), self.streams.mark())
        self.stats.bytes_in += unit.nbytes
        self._lend(unit, weights, grads=False)
        self._lend(unit, grads, grads=True)

    def new_step(self) -> None:
        """A training step begins: settle what an evaluation left lent; no norms taken yet."""
        self.settle()
        self.forwards = 0
        if self.norms is not None:
            self.norms.clear()

    def skip_zeroing(self) -> None:
        """The framework skipped zeroing the host gradients: each unit's first copy out will overwrite them."""
        for unit in self.units:
            unit.grads_stale = True

    def settle(self) -> None:
        """End of a step's backward (or before a new step): see the docstring's NOTE."""
        if self.resident is not None and self.resident.lent:
            weights, grads = self.resident_slots
            if self.backward_ran:
                self._gradients_out(self.resident, grads, final=True)
            self._give_back(self.resident)
            grads.in_use, weights.in_use = False, False
            self.resident.grads_on_host = False  # the next step's sum starts at zero on the GPU
        for unit in self.layers:
            if unit.grads_in is not None and unit.grads_in.in_use:
                self._gradients_out(unit, unit.grads_in, final=True)  # a backward whose input hook never fired
            if unit.lent:
                self._give_back(unit)
            unit.grads_on_host = False
        for unit in self.units:
            if unit.grads_stale:  # no backward wrote it since the zeroing was skipped: zero, as the framework would
                unit.zero_host_grads()
        if self.last_out is not None:
            # On the device: the optimizer's kernels read the host gradients after the last copy out.
            self._wait(self.last_out)
            self.last_out = None
        self.weights.forget("weights_in")
        self.grads.forget("grads_in")
        self.backward_ran = False

    # ------------------------------------------------------------------------------ internals
    def _distance(self, unit: Unit) -> int:
        return self.schedule.distance(unit.index, self.now)

    def _slot_with_weights(self, unit: Unit, needed_in: int = 0) -> Slot | None:
        slot = unit.weights_in
        if slot is None:
            slot = self.weights.pick(self._distance, needed_in)
            if slot is None:
                return None
            self.weights.assign(slot, unit, "weights_in")
            # After a compute mark: the slot's last reader and the step's writes to the host copy are done.
            _, slot.ready = self.streams.copy(PREFETCH, unit.weight_pairs(slot.buffer), self.streams.mark())
            self.stats.bytes_in += unit.nbytes
        return slot

    def _slot_with_grads(self, unit: Unit, needed_in: int = 0) -> Slot | None:
        slot = unit.grads_in
        if slot is None:
            slot = self.grads.pick(self._distance, needed_in)
            if slot is None:
                return None
            self.grads.assign(slot, unit, "grads_in")
            if unit.grads_on_host:
                # After the latest copy out: the slot's previous contents and this unit's host sum have left.
                _, slot.ready = self.streams.copy(PREFETCH, unit.grad_pairs(slot.buffer, to_host=False), self.last_out)
                self.stats.bytes_in += unit.grad_nbytes
        return slot

    def _lend(self, unit: Unit, slot: Slot, grads: bool) -> None:
        if slot.ready is not None:
            self._wait(slot.ready)  # on the device: the copy filling the slot lands before the layer reads it
            slot.ready = None
        if grads and not unit.grads_on_host and not unit.summing:
            if slot.free_after is not None:
                self._wait(slot.free_after)  # the slot's last copy out must have read it before it is zeroed
                slot.free_after = None
            slot.buffer[: unit.numel].zero_()  # first micro-batch: the sum starts at zero, as the framework's
        slot.in_use = True
        for placed, view in zip(unit.placed, slot.views_for(unit, grads), strict=True):
            if grads:
                setattr(placed.param, self.grad_attr, view)
            else:
                placed.param.data = view
        unit.lent = True

    def _give_back(self, unit: Unit) -> None:
        """Point the unit's params back at their host copies; its weight slot may be refilled."""
        for placed in unit.placed:
            placed.param.data = placed.host_data
            if placed.host_grad is not None:
                setattr(placed.param, self.grad_attr, placed.host_grad)
        if unit.weights_in is not None:
            unit.weights_in.in_use = False
        unit.lent = False

    def _gradients_out(self, unit: Unit, slot: Slot | None, final: bool = False) -> None:
        if slot is None:
            return
        if final and self.norms is not None:
            self.norms.take(unit.index, slot.buffer)  # before the mark below: the copy out waits for the norms
        # After a compute mark: every gradient of the unit has been accumulated into the slot.
        _, end = self.streams.copy(OFFLOAD, unit.grad_pairs(slot.buffer, to_host=True), self.streams.mark())
        self.last_out = self.grads.copied_out(slot, end)  # the resident slot too: one count, one stream of copies out
        slot.in_use = False
        if not unit.resident:
            slot.unit, unit.grads_in = None, None
        unit.grads_on_host, unit.grads_stale, unit.summing = True, False, False
        self.stats.bytes_out += unit.grad_nbytes

    def _prefetch(self) -> None:
        for ahead in range(1, self.depth + 1):
            index, backward = self.schedule.layer_at(self.now + ahead)
            unit = self.layers[index]
            if self._slot_with_weights(unit, ahead) is None:
                return  # every slot holds a layer needed sooner
            if backward and ahead == 1 and unit.grads_on_host:
                self._slot_with_grads(unit, ahead)

    def _wait(self, event: Event) -> None:
        if event.query():
            return  # landed already: no wait on the device at all
        start, end = self.streams.compute_waits(event)
        self.stats.add_wait(start, end)
