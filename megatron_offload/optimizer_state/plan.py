"""Where each byte of offloadable optimizer state lives: chunks of whole parameters, laid out in one
host slab. Knows nothing of copies, streams or Megatron.

A chunk, the unit that moves, holds every offloadable tensor of a run of parameters in step order, at
aligned offsets in one device block and in the same order in the slab: one copy per move (two after
Adam's first step, whose moments go at the end of the slab).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_offload.core.units import MIB
from megatron_offload.optimizer_state.pieces import Memory

logger = logging.getLogger(__name__)

__all__ = [
    "ALIGN",
    "Chunk",
    "Entry",
    "Plan",
    "aligned",
    "offloadable_tensors",
    "owns_its_storage",
    "runs",
    "view",
]

ALIGN = 256  # byte alignment of every tensor inside a chunk (and of chunks in the host slab)


@dataclass
class Entry:
    """One state tensor of a chunk."""

    tensor: torch.Tensor  # the optimizer's own tensor object; its .data moves between GPU and host
    host: torch.Tensor  # view into the host slab, same shape and dtype
    host_offset: int  # byte offset in the host slab
    offset: int  # byte offset inside its chunk's device block
    nbytes: int
    is_param: bool  # an optimizer param (a master weight): megatron assigns its .grad during the step
    in_block: bool = True  # False for state the optimizer has just made, not yet in a block of ours


@dataclass(eq=False)
class Chunk:
    """A run of parameters' state that moves as one piece."""

    index: int
    entries: list[Entry]
    params: list[torch.Tensor]  # the optimizer params whose state this chunk holds
    nbytes: int  # size of its device block
    expected: int = 0  # its size once Adam's first step has added the moments (the plan reserved room)
    kept: bool = False  # stays on the GPU across steps (offload fraction below 1, or chosen by `auto`)
    on_gpu: bool = True  # its tensors point at GPU memory (its block, or storage of their own), else at the slab
    block: Memory | None = None  # uint8 device memory the entries view on the GPU (None: their own)
    ready: Any = None  # event the compute stream waits for before using the block (a copy back, or one out reading it)
    touched: bool = True  # the compute stream may have changed it since its host copy was made
    copy: Any = None  # the engine's copy of this chunk that is queued or in flight, if any

    def label(self, total: int) -> str:
        return f"chunk {self.index + 1} of {total} ({self.nbytes / MIB:.1f} MiB, {len(self.params)} params)"


@dataclass
class Plan:
    """The chunks and where their state sits in the host slab."""

    chunks: list[Chunk] = field(default_factory=list)
    key: tuple = ()  # identity of the tensor set it was made for: a new set needs a new plan
    planned: set[int] = field(default_factory=set)  # id() of every tensor in a chunk
    slab_used: int = 0  # bytes of the slab in use; Adam's first moments are added after them
    loose_masters: bool = False  # some master is not an optimizer param: the step cannot be chunked
    # Chunks before this index are on the GPU or on their way back: the offloader's prefetch walks on from
    # here (the backward's hooks call it dozens of times) and sets it back to 0 wherever a chunk may leave.
    back_until: int = 0

    @property
    def host_bytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    def full_bytes(self) -> int:
        """Every chunk's size once Adam's first step has added the moments (the slab's room)."""
        return sum(max(chunk.nbytes, chunk.expected) for chunk in self.chunks)

    def kept_bytes(self, to_come: bool = True) -> int:
        """State kept on the GPU; with ``to_come``, counting the moments Adam's first step will add."""
        return sum(max(c.nbytes, c.expected) if to_come else c.nbytes for c in self.chunks if c.kept)


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """True when freeing the tensor's storage frees nothing but the tensor (no views of a shared buffer)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def shaped_like(value: object, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value is not param and value.shape == param.shape


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def view(block: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """``like``'s shape and dtype over ``block`` (uint8) from byte ``offset``."""
    return block[offset : offset + nbytes_of(like)].view(like.dtype).view(like.shape)


def runs(entries: list[Entry]) -> list[tuple[int, int, int]]:
    """(host offset, block offset, bytes) of each stretch that is contiguous on both sides: one copy each.
    A chunk has one, or two after Adam's first step added its moments at the end of the slab."""
    found: list[list[int]] = []
    for entry in sorted(entries, key=lambda e: e.offset):
        size = aligned(entry.nbytes)
        if found and found[-1][0] + found[-1][2] == entry.host_offset and found[-1][1] + found[-1][2] == entry.offset:
            found[-1][2] += size
        else:
            found.append([entry.host_offset, entry.offset, size])
    return [(host, block, size) for host, block, size in found]


def all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def offloadable_tensors(
    optimizer: torch.optim.Optimizer,
    master_weights: Sequence[torch.Tensor],
    keep_state_keys: frozenset[str],
    planned: set[int],
    warned: set[int],
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """(tensor, the optimizer param it belongs to, or None for a loose master), in step order. Entries
    that share storage with other tensors are skipped (freeing them would free others' memory)."""
    seen: set[int] = set()

    def fresh(tensor: torch.Tensor) -> bool:
        new = id(tensor) not in seen
        seen.add(id(tensor))
        return new and tensor.numel() > 0

    masters = {id(tensor) for tensor in master_weights}
    for param in all_params(optimizer):
        if id(param) in masters and fresh(param):
            yield param, param
        for key, value in optimizer.state.get(param, {}).items():
            if key in keep_state_keys or not shaped_like(value, param):
                continue
            if id(value) not in planned and not owns_its_storage(value):
                if id(value) not in warned:
                    warned.add(id(value))
                    logger.warning("optimizer state %r shares its storage; keeping it on the GPU", key)
                continue
            if fresh(value):
                yield value, param
    for tensor in master_weights:
        if fresh(tensor):
            yield tensor, None


def plan_key(found: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple:
    return tuple((id(t), t.dtype, t.numel()) for t, _ in found)


Cut = list[tuple[torch.Tensor | None, list[torch.Tensor], int]]  # (param, its tensors, expected bytes)


def cut(optimizer: torch.optim.Optimizer, found: list, chunk_bytes: int) -> list[Cut]:
    """Whole parameters in step order, cut about every ``chunk_bytes``. A param without state yet counts
    the two Adam moments its first step will create, which then join its chunk."""
    tensors_of: dict[int, list[torch.Tensor]] = {}
    for tensor, param in found:
        tensors_of.setdefault(id(param) if param is not None else id(tensor), []).append(tensor)
    owners = [(p, tensors_of.get(id(p), [])) for p in all_params(optimizer)]
    owners += [(None, [t]) for t, p in found if p is None]  # masters outside the optimizer
    cuts: list[Cut] = []
    size = 0
    for param, tensors in owners:
        expected = sum(aligned(nbytes_of(t)) for t in tensors)
        # (Megatron's masters do not require grad, yet Adam steps them: their grads are set by hand.)
        if param is not None and not optimizer.state.get(param):
            expected += 2 * aligned(nbytes_of(param))
        if not cuts or size >= chunk_bytes or param is None:
            cuts.append([])
            size = 0
        cuts[-1].append((param, tensors, expected))
        size += expected
    return cuts


def lay_out(cuts: list[Cut], slab: torch.Tensor, key: tuple, kept: Collection[int]) -> Plan:
    """The chunks over ``slab``: chunk i's tensors at consecutive aligned offsets; the chunks whose
    index is in ``kept`` are kept on the GPU. Tensors start outside any block (``in_block`` False): their
    values exist only where they are until the first offload copies them."""
    chunks, start = [], 0
    for index, piece in enumerate(cuts):
        entries, offset = [], 0
        for param, tensors, _ in piece:
            for tensor in tensors:
                host = view(slab, start + offset, tensor)
                entries.append(Entry(tensor, host, start + offset, offset, nbytes_of(tensor), param is tensor, False))
                offset += aligned(nbytes_of(tensor))
        params = [param for param, _, _ in piece if param is not None]
        expected = sum(e for _, _, e in piece)
        chunks.append(Chunk(index, entries, params, offset, expected, kept=index in kept, touched=True))
        start += offset
    return Plan(
        chunks=chunks,
        key=key,
        planned={id(entry.tensor) for chunk in chunks for entry in chunk.entries},
        slab_used=start,
        loose_masters=any(param is None for piece in cuts for param, _, _ in piece),
    )


def adopt_new_state(plan: Plan, chunk: Chunk, optimizer: torch.optim.Optimizer, keys: frozenset, slab) -> int:
    """Plan the state the optimizer has just created for the chunk's params (Adam's moments, at its first
    step) into the chunk, with host room at the end of the slab, so it moves with the chunk instead of
    making the whole state come back for a new plan. Returns the host bytes added (0: no room; left for
    the next plan)."""
    added = 0
    for param in chunk.params:
        for key, value in optimizer.state.get(param, {}).items():
            if id(value) in plan.planned or key in keys or not shaped_like(value, param):
                continue
            nbytes = nbytes_of(value)
            if plan.slab_used + aligned(nbytes) > slab.numel():
                return added
            host = view(slab, plan.slab_used, value)
            chunk.entries.append(Entry(value, host, plan.slab_used, chunk.nbytes, nbytes, False, in_block=False))
            plan.slab_used += aligned(nbytes)
            chunk.nbytes += aligned(nbytes)
            plan.planned.add(id(value))
            added += aligned(nbytes)
    return added
