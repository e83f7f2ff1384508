"""The host-memory drills' verdicts on the CPU (tests/gpu/host_memory_verdicts.py): which cases each drill
and ``--only`` run, the one-clear-line rule, and the verdict lines of the JSON the drill writes.
"""

from __future__ import annotations

import pytest

from tests.gpu import host_memory_verdicts as verdicts


def test_only_selects_drills_and_cases_in_the_drills_order() -> None:
    assert verdicts.select(None) == verdicts.CASES and len(verdicts.CASES) == 8
    assert verdicts.select(["short-during-save"]) == ["host-short-during-save"]
    assert verdicts.select(["node-too-small", "short-while-pinning"]) == [
        "node-too-small", "slab-pinned", "slab-pin-refused-raises", "pin-refused-at-attach", "pin-refused-megatron",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown drills or cases \\['short-at-end'\\]"):
        verdicts.select(["short-at-end"])


def test_what_the_user_is_told_must_be_one_clear_line() -> None:
    assert verdicts.one_line("megatron-offload: could not pin 1.00 GiB of host memory") == []
    assert verdicts.one_line("") == ["the message is empty: the user was told nothing"]
    assert verdicts.one_line("Traceback (most recent call last):\n  File x\nHostMemoryError: y", "the warning") == [
        "the warning spans 3 lines, not one"
    ]


def test_each_case_and_drill_ends_with_one_verdict_line_and_a_missing_case_fails() -> None:
    report = {
        "cases": {
            "allocation-refused-at-attach": {"passed": True, "failures": []},
            "node-too-small": {"passed": False, "failures": ["the refusal came with a traceback, not one line"]},
            "host-short-during-save": {"passed": True, "failures": []},
        }
    }
    cases = verdicts.select(["short-at-start", "short-during-save"])
    verdicts.add_verdicts(report, cases)
    assert report["cases"]["node-too-small-check-off"]["verdict"] == "FAIL: did not run (the drill was cut short)"
    assert report["drills"]["short-during-save"] == {"cases": ["host-short-during-save"], "verdict": "PASS"}
    assert report["drills"]["short-at-start"]["verdict"] == (
        "FAIL: node-too-small: the refusal came with a traceback, not one line"
        " | node-too-small-check-off: did not run (the drill was cut short)"
    )
    assert "short-while-pinning" not in report["drills"]
    assert report["verdict"] == "FAIL" and report["passed"] is False
    assert verdicts.lines(report)[-1] == "host-memory drills: FAIL"
    passing = verdicts.add_verdicts({"cases": {"host-short-during-save": {"passed": True}}}, ["host-short-during-save"])
    assert passing["verdict"] == "PASS" and verdicts.lines(passing) == [
        "short-during-save      PASS",
        "host-memory drills: PASS",
    ]
