"""What stays on the GPU, asked for in bytes (``keep_bytes``, the scheduler's unit) or as a fraction
(``set_fraction``, the Python API's and ``--offload-fraction F``'s): the same chunks either way."""

from __future__ import annotations

import pytest
import torch

from megatron_offload import OptimizerStateOffloader
from megatron_offload.optimizer_state import plan as planning

LAYOUTS = [  # (parameter sizes, chunk bytes)
    ((37, 1000, 5, 300, 64, 700, 1), 2000),
    ((37, 1000, 5), 1),  # a chunk per parameter
    ((500,) * 6, 3000),  # equal chunks: fractions land on their halves
    ((1, 2, 3, 4000, 5, 600, 7000, 8), 5000),
    ((64,) * 40, 1),
]
FRACTIONS = [i / 20 for i in range(21)] + [0.01, 1 / 3, 0.499, 0.501, 2 / 3, 0.99]


def offloader_of(sizes: tuple[int, ...], chunk_bytes: int, stepped: bool) -> OptimizerStateOffloader:
    """fp32 masters that are the optimizer's params; ``stepped``: Adam's moments exist already."""
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    if stepped:
        for master in masters:
            master.grad = torch.randn(master.shape)
        optimizer.step()
    return OptimizerStateOffloader(
        optimizer, masters, chunk_bytes=chunk_bytes, pin_memory=False, check_host_memory=False
    )


def kept_flags(offloader: OptimizerStateOffloader) -> list[bool]:
    return [chunk.kept for chunk in offloader.chunks]


@pytest.mark.parametrize("stepped", [False, True], ids=["before-adams-first-step", "after"])
@pytest.mark.parametrize(("sizes", "chunk_bytes"), LAYOUTS)
def test_keeping_bytes_selects_the_chunks_the_fraction_does(sizes, chunk_bytes: int, stepped: bool) -> None:
    offloader = offloader_of(sizes, chunk_bytes, stepped)
    offloader.offload()
    total = offloader.plan.full_bytes()
    assert len(offloader.chunks) > 1
    for fraction in FRACTIONS:
        offloader.set_fraction(fraction)
        by_fraction = kept_flags(offloader)
        kept = offloader.keep_bytes(round((1 - fraction) * total))
        assert kept_flags(offloader) == by_fraction, fraction
        assert kept == offloader.kept_bytes == offloader.plan.kept_bytes()
        # A plan made later (a checkpoint load) keeps by the same bytes.
        later = offloader_of(sizes, chunk_bytes, stepped)
        later.keep_bytes(round((1 - fraction) * total))
        later.offload()
        assert kept_flags(later) == by_fraction, fraction


def test_kept_bytes_round_at_half_a_chunk() -> None:
    sizes = [1024, 2048, 512]
    assert planning.kept_from_bytes(sizes, 0) == 3
    assert planning.kept_from_bytes(sizes, 256) == 3  # half the last chunk: not more than half of it asked
    assert planning.kept_from_bytes(sizes, 257) == 2
    assert planning.kept_from_bytes(sizes, 512 + 1024) == 2  # the middle one's half: offloaded
    assert planning.kept_from_bytes(sizes, 512 + 1025) == 1
    assert planning.kept_from_bytes(sizes, 3584) == 0
    for kept in range(0, 3584 + 1, 128):
        assert planning.kept_from_bytes(sizes, kept) == planning.kept_from(sizes, 1 - kept / 3584), kept
