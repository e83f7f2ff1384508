"""The floor of weight streaming's optimizer step over the host link a benchmark call measured, and which
rows get it (benchmarks/link_speed.py; the measurement itself needs a GPU)."""

from __future__ import annotations

import pytest

from benchmarks.link_speed import GIB, step_floor_ms, with_step_floors

LINK = {"in_GBps": 50.0, "out_GBps": 40.0, "both_GBps": 100.0}


def test_the_floor_is_the_slowest_of_each_way_and_both_at_once() -> None:
    # 1e9 parameters: 8 GB in (masters, gradients), 6 GB out (masters, bf16 weights).
    assert step_floor_ms(10**9, 0, LINK) == pytest.approx(160.0)  # in: 8 GB / 50 GB/s
    # With 4 GB of optimizer state moved each way: in 240 ms, out 250 ms, both at once 220 ms.
    assert step_floor_ms(10**9, 4e9, LINK) == pytest.approx(250.0)
    # A link whose directions do not add up: both at once is the bound.
    assert step_floor_ms(10**9, 0, {"in_GBps": 100.0, "out_GBps": 100.0, "both_GBps": 70.0}) == pytest.approx(200.0)


def row(flags: list[str], **figures: object) -> dict:
    return {"argv": ["-m", "megatron_offload.run", "pretrain_gpt.py", *flags], **figures}


def test_only_weight_streaming_rows_get_their_step_beside_the_floor() -> None:
    results = {
        "weights": row(["--offload-weights"], step_ms=1000.0, forward_backward_ms=700.0, parameters=10**9,
                       offloaded_GiB=4e9 / GIB),
        "no offload": row([], step_ms=600.0, forward_backward_ms=560.0, parameters=10**9),
        "weights, out of memory": row(["--offload-weights"], returncode=1, parameters=10**9),
    }  # fmt: skip
    with_step_floors(results, LINK)
    weights = results["weights"]
    assert weights["optimizer_step_ms"] == 300.0 and weights["optimizer_step_floor_ms"] == 250.0
    assert weights["optimizer_step_over_floor"] == 1.2 and weights["host_link_measured"] == LINK
    assert not any(key.startswith(("optimizer_step", "host_link")) for key in results["no offload"])
    failed = results["weights, out of memory"]
    assert failed["host_link_measured"] == LINK and "optimizer_step_floor_ms" not in failed


def test_a_link_that_could_not_be_measured_gives_no_floor() -> None:
    results = {"weights": row(["--offload-weights"], step_ms=1.0, forward_backward_ms=0.5, parameters=1)}
    with_step_floors(results, {"error": "no CUDA GPU"})
    assert results["weights"]["host_link_measured"] == {"error": "no CUDA GPU"}
    assert "optimizer_step_floor_ms" not in results["weights"]


def test_the_link_is_measured_in_a_process_of_its_own_or_the_reason_is_given() -> None:
    import torch

    from benchmarks.link_speed import measured

    link = measured()
    if torch.cuda.is_available():
        assert set(link) == {"in_GBps", "out_GBps", "both_GBps"} and min(link.values()) > 0, link
    else:
        assert link == {"error": "link_speed: no CUDA GPU here: the host link is measured on the GPU machine"}
