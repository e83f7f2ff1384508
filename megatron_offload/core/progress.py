"""Progress lines for the waits a user would otherwise sit through in silence. Pinning a multi-GB host
slab (``cudaHostRegister``) takes seconds at start-up, before the first iteration's log line."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from megatron_offload.core.units import GIB

__all__ = ["pin_progress", "say"]

MIN_BYTES = GIB // 4  # below this pinning takes well under a second: say nothing


def _first_rank() -> bool:
    """Rank 0 of the job (torchrun's RANK before torch.distributed starts, its rank after)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def say(message: str, *, stream: TextIO | None = None) -> None:
    """One line of the product's, on the job's first rank only."""
    if _first_rank():
        print(message, file=stream or sys.stderr, flush=True)


@contextmanager
def pin_progress(
    nbytes: int,
    what: str = "host memory",
    *,
    stream: TextIO | None = None,
    min_bytes: int = MIN_BYTES,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[None]:
    """Wrap the pinning of ``nbytes``: on the first rank, a line before ("pinning 12.00 GiB of host
    memory ...") and one after with the time and rate, so a slow start is explained and measured. Says
    nothing for small amounts, on other ranks, or after an error (the error speaks)."""
    show = nbytes >= min_bytes
    head = f"megatron-offload: pinning {nbytes / GIB:.2f} GiB of {what} ..."
    if show:
        say(head, stream=stream)
    start = clock()
    yield
    if show:
        seconds = max(clock() - start, 1e-9)
        say(f"{head} done in {seconds:.1f} s ({nbytes / GIB / seconds:.1f} GiB/s)", stream=stream)
