"""benchmarks/megatron_job.py's reading of time per iteration: which logged iterations the median counts."""

from __future__ import annotations

from benchmarks.megatron_job import steady


def test_interval_1_counts_from_the_third_iteration() -> None:
    assert steady(list(range(1, 16))) == list(range(3, 16))  # iterations 1 and 2 build and warm up


def test_interval_k_counts_the_lines_from_2k_read_from_the_logged_numbers() -> None:
    # Megatron's line at 5 is the mean of iterations 1-5 (or 2-5), slow ones among them.
    assert steady([1, 5, 10, 15]) == [10, 15]
    assert steady([5, 10, 15, 20, 25, 30, 35, 40]) == [10, 15, 20, 25, 30, 35, 40]
    assert steady([2, 4, 6, 8]) == [4, 6, 8]  # at 2, from iteration 4 (and never before the third)


def test_short_runs_keep_what_they_have() -> None:
    assert steady([1, 5]) == [5]  # nothing from 2k on: all but the first line
    assert steady([1]) == [1] and steady([]) == []
