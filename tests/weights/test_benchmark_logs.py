"""The weight-streaming benchmark reads Megatron's forward-backward timer and our weights fields."""
# ruff: noqa: E501  (log lines as Megatron prints them)

from __future__ import annotations

from benchmarks.weight_streaming import log_figures

LOG = """
 [2026-11-25] iteration        1/      10 | elapsed time per iteration (ms): 9000.0 | weights in/out per iter (GiB): 9.00/4.00 | weights exposed (ms): 50.0 | host-mapped (GiB): 12.00 |
(min, max) time across ranks (ms):
    forward-backward ...............................: (8000.00, 8100.00)
 [2026-11-25] iteration        2/      10 | elapsed time per iteration (ms): 3000.0 | weights in/out per iter (GiB): 8.50/4.25 | weights exposed (ms): 1.5 | host-mapped (GiB): 12.00 |
(min, max) time across ranks (ms):
    forward-backward ...............................: (2900.00, 2950.00)
    forward-backward ...............................: (2800.00, 2850.00)
"""


def test_timer_after_the_first_interval_and_the_last_weights_fields() -> None:
    figures = log_figures(LOG)
    assert figures["forward_backward_ms"] == 2900.0  # median of 2950 and 2850; the warm-up 8100 left out
    assert (figures["weights_in_GiB"], figures["weights_out_GiB"], figures["weights_exposed_ms"]) == (8.5, 4.25, 1.5)
