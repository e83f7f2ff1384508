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


def megatron_log(losses: dict[int, str], norm: str = "2.389") -> str:
    """Megatron's iteration lines (the parts the drill reads) with these logged losses."""
    return "".join(
        f" [2026-11-25 10:00:00.000000] iteration {i:8d}/      10 | consumed samples: {8 * i:12d} | lm loss: {loss} |"
        f" loss scale: 1.0 | grad norm: {norm} | number of skipped iterations:   0 |\n"
        for i, loss in losses.items()
    )


# Iterations 6-10 as the refused run logs them, and as the run resumed from iteration 5 logs them: Megatron
# logs a process's second iteration as the mean of its first two (training_log keeps the loss sums of a
# process's first iteration), so iteration 7 differs with and without offloading alike.
REFUSED = megatron_log({6: "9.991E+00", 7: "9.978575E+00", 8: "9.951E+00", 9: "9.940E+00", 10: "9.930E+00"})
RESUMED = megatron_log({6: "9.991E+00", 7: "1.003003E+01", 8: "9.951E+00", 9: "9.940E+00", 10: "9.930E+00"})


def test_a_resume_difference_the_control_shows_too_is_megatron_cores_and_passes() -> None:
    from tests.gpu import host_memory_megatron as drill

    verdict = drill.resume_verdict((REFUSED, RESUMED), (REFUSED, RESUMED))
    assert verdict.failures == [] and verdict.status == "megatron-core's difference"
    assert verdict.megatron_core == [
        "iteration 7 lm loss: 9.978575E+00 uninterrupted, 1.003003E+01 resumed; the same without offloading"
    ]
    assert drill.resume_verdict((REFUSED, REFUSED), (REFUSED, REFUSED)).status == "pass"


def test_a_resume_difference_without_a_control_or_only_with_offloading_fails() -> None:
    from tests.gpu import host_memory_megatron as drill

    alone = drill.resume_verdict((REFUSED, RESUMED), None)
    assert alone.failures == [
        "iteration 7 lm loss: 9.978575E+00 uninterrupted, 1.003003E+01 resumed (no control to tell whose)"
    ]
    ours = drill.resume_verdict((REFUSED, RESUMED), (REFUSED, REFUSED))
    assert ours.status == "FAIL" and "the run without offloading resumed equal" in ours.failures[0]
    norms = drill.resume_verdict((REFUSED, megatron_log(dict.fromkeys(range(6, 11), "9.9E+00"), "2.4")), (REFUSED,) * 2)
    assert norms.status == "FAIL" and any("grad norm" in failure for failure in norms.failures)
