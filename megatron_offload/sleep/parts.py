"""The parts a sleep can move, by name, and the pinned host memory they need.

Host memory is pinned by ``prepare()``, which an RL framework calls at setup, so that the first sleep
runs at the link's speed like every later one; a part that was not prepared is pinned by its first
sleep (said in the log). Where the state already lives on the host between steps (an attached
``--offload-optimizer-states`` handle), its offloaders and their slab are used as they are: no byte
is pinned twice.

``SleepParts`` holds the parts (optimizer offloaders; flat device buffers, parked whole), checks that
the host has room for what they would newly pin, and pins it; a ``Sleeper`` (sleeper.py) holds one and
moves them. Of the engine it uses ``prepare()`` and ``estimated_host_bytes()``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from megatron_offload.core.host_memory import HOST_MEMORY_HEADROOM, available_host_bytes
from megatron_offload.core.units import GIB
from megatron_offload.optimizer_state.offloader import OptimizerStateOffloader
from megatron_offload.sleep.parked_buffers import ParkedBuffers, Transfer
from megatron_offload.sleep.report import SleepError, SleepReport

__all__ = ["OPTIMIZER", "SleepParts"]

OPTIMIZER = "optimizer"  # the part name of the optimizer state; every other part is a set of buffers


class SleepParts:
    """The named parts of a sleep and their host memory: the optimizer state and the buffers' storages.

    ``offloaders`` hold the optimizer state (and fp32 masters); with ``state_lives_on_host`` their slab
    was pinned already (an attached handle's). ``buffers`` maps a part name to the tensors whose
    storages it parks.
    """

    def __init__(
        self,
        offloaders: Sequence[OptimizerStateOffloader],
        buffers: dict[str, Sequence[torch.Tensor]],
        *,
        state_lives_on_host: bool,
        chunk_bytes: int,
        pin_memory: bool,
    ) -> None:
        self.offloaders = list(offloaders)
        self.buffers = {
            name: ParkedBuffers(name, tensors, chunk_bytes, pin_memory) for name, tensors in buffers.items()
        }
        self.state_lives_on_host = state_lives_on_host
        self._state_pinned = state_lives_on_host  # the handle's slab holds the state already

    @property
    def parts(self) -> tuple[str, ...]:
        return (OPTIMIZER, *self.buffers)

    def names(self, parts: Sequence[str], what: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(parts))
        unknown = [name for name in names if name not in self.parts]
        if unknown or not names:
            raise SleepError(f"cannot {what} {unknown or 'nothing'}: choose among {', '.join(self.parts)}")
        return names

    def pinned(self, name: str) -> bool:
        return self._state_pinned if name == OPTIMIZER else self.buffers[name].slab is not None

    def host_bytes_needed(self, parts: Sequence[str]) -> int:
        """Host memory a prepare or sleep of ``parts`` would newly pin (slabs that exist are reused)."""
        needed = sum(self.buffers[name].host_bytes_needed() for name in parts if name in self.buffers)
        if OPTIMIZER in parts and not self._state_pinned:
            needed += sum(o.estimated_host_bytes() for o in self.offloaders)
        return needed

    def check_host_room(self, parts: Sequence[str], what: str) -> None:
        needed = self.host_bytes_needed(parts)
        available = available_host_bytes()
        if needed > available * HOST_MEMORY_HEADROOM:
            raise SleepError(
                f"{what} needs {needed / GIB:.2f} GiB of new pinned host memory but {available / GIB:.2f} GiB is "
                f"available ({1 - HOST_MEMORY_HEADROOM:.0%} kept free): sleep fewer parts or free host memory"
            )

    def prepare(self, parts: Sequence[str] = (OPTIMIZER,)) -> SleepReport:
        """Pin the host memory a sleep of ``parts`` needs, now (about 0.5 s per GiB; a progress line per
        slab on the first rank), so that the first sleep runs at the link's speed. Nothing moves; safe to
        call again (slabs that exist are kept). Call it at setup, before the first rollout."""
        names = self.names(parts, "prepare")
        self.check_host_room(names, "prepare")
        report = SleepReport("prepare")
        start = time.perf_counter()
        report.transfers = [self.pin(name) for name in names]
        report.seconds = time.perf_counter() - start
        return report

    def pin(self, name: str) -> Transfer:
        start = time.perf_counter()
        if name != OPTIMIZER:
            nbytes = self.buffers[name].prepare()
        elif self._state_pinned:
            nbytes = 0  # in the handle's slab, or pinned before
        else:
            nbytes = sum(o.estimated_host_bytes() for o in self.offloaders)
            for offloader in self.offloaders:
                offloader.prepare()  # plans the state and pins its slab; no copies
            self._state_pinned = True
        return Transfer(name, nbytes, time.perf_counter() - start)
