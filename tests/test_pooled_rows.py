"""A row of several runs: what the caching allocator's retries cost it, beside its total (benchmarks/pooled_rows.py),
as the memory-speed curve's cells and text give it."""

from __future__ import annotations

from benchmarks import memory_speed_curve as curve
from benchmarks.pooled_rows import retries_text, retry_figures

LINES = [str(i) for i in range(5, 41, 5)]  # the lines of 40 iterations at interval 5


def run(ms: list[float], retries: list[int]) -> dict[str, dict[str, float]]:
    return {"step_ms_by_iteration": dict(zip(LINES, ms, strict=True)),
            "allocator_retries_by_iteration": dict(zip(LINES, retries, strict=True))}  # fmt: skip


# One run under the 90% cap at --log-interval 5 (one H200): no retry until iteration 25, then one in each of the
# four micro-batches' forwards, every iteration.
LATE_RETRIES = run([1190.1, 790.7, 803.6, 803.3, 812.8, 831.6, 876.1, 866.6], [0, 0, 0, 0, 0, 20, 21, 20])
# Its second round, which never retried.
NEVER_RETRIED = run([1142.3, 761.0, 740.8, 788.2, 766.6, 784.0, 783.3, 756.7], [0] * 8)
INTERVAL_5 = curve.iterations_for(5)[1]


def test_a_row_whose_late_lines_retried_gives_their_median_beside_the_others() -> None:
    row = curve.pooled_cell([LATE_RETRIES, NEVER_RETRIED], None, INTERVAL_5)
    assert row["allocator_retries"] == 61
    split = row["retrying_lines"]
    assert (split["lines"], split["of"]) == (3, 14)  # iterations 10-40 of both runs; the warm-up line left out
    assert split["ms_retrying"] == 866.6
    assert split["ms_without"] == 784.0  # the median of the other eleven, both runs'
    assert "allocator retries 61 (in 3 of 14 lines: 867 ms against 784 without)" in retries_text(row)


def test_the_curve_prints_what_the_retries_cost_in_its_cell() -> None:
    row = curve.pooled_cell([LATE_RETRIES], None, INTERVAL_5)
    result = {
        "global_batch": 8, "micro_batches": 4, "log_interval": 5, "state": {"GiB": 10.67},
        "no_offload": {"ms_per_iter": 586.2}, "link": {"GBps": 51.9, "source": "measured"},
        "caps": [{"percent": 90, "cap_GiB": 17.02, "saved_GiB": 9.61, "floor_x": 1.256, "rows": {"default": row}}],
    }  # fmt: skip
    text = curve.table(result)
    assert "allocator retries 61 (in 3 of 7 lines: 867 ms against 803 without)" in text


def test_a_row_that_never_retried_or_never_counted_says_nothing_of_a_split() -> None:
    assert retry_figures([(0, 700.0), (0, 710.0)]) == {"allocator_retries": 0}
    assert retries_text({"allocator_retries": 0}) == ""
    assert retry_figures([(None, 500.0), (None, 510.0)]) == {}  # no offload logs no retries
    every_line = retry_figures([(4, 800.0), (8, 820.0)])
    assert every_line == {"allocator_retries": 12}  # nothing to set them against
    assert retries_text(every_line) == "  allocator retries 12"
