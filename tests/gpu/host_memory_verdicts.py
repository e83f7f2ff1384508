"""The verdicts of the host-memory drills (tests/gpu/host_memory_drill.py), without a GPU: which cases make
each drill, which cases a ``--only`` asks for, and the one line each case, drill and run ends with.

A drill passes when every case of it passed: the user was told in one clear line (a warning, or an error
that is one line and no traceback of ours), nothing was left half set up, and nothing was lost (training
on is bitwise what it would have been, a save cut short is not what a new run loads).
"""

from __future__ import annotations

from typing import Any

DRILLS = {  # drill -> its cases, in the order they run
    "short-at-start": ["allocation-refused-at-attach", "node-too-small", "node-too-small-check-off"],
    "short-while-pinning": ["slab-pinned", "slab-pin-refused-raises", "pin-refused-at-attach", "pin-refused-megatron"],
    "short-during-save": ["host-short-during-save"],
}
API_CASES = ["slab-pinned", "slab-pin-refused-raises", "pin-refused-at-attach", "allocation-refused-at-attach"]
CASES = [name for cases in DRILLS.values() for name in cases]


def select(only: list[str] | None) -> list[str]:
    """The cases to run, in the drills' order: every one, or those named (a drill names its cases)."""
    if not only:
        return list(CASES)
    unknown = [name for name in only if name not in DRILLS and name not in CASES]
    if unknown:
        raise ValueError(f"unknown drills or cases {unknown}; drills: {list(DRILLS)}; cases: {CASES}")
    wanted = {case for name in only for case in DRILLS.get(name, [name])}
    return [case for case in CASES if case in wanted]


def one_line(message: str, what: str = "the message") -> list[str]:
    """A failure unless ``message`` is one non-empty line: what the user is told must be one clear line."""
    if not message.strip():
        return [f"{what} is empty: the user was told nothing"]
    if "\n" in message.strip():
        return [f"{what} spans {len(message.strip().splitlines())} lines, not one"]
    return []


def case_verdict(item: dict[str, Any]) -> str:
    """``PASS`` or ``FAIL: failure; failure``."""
    return "PASS" if item.get("passed") else "FAIL: " + "; ".join(item.get("failures") or ["no result"])


def add_verdicts(report: dict[str, Any], cases: list[str]) -> dict[str, Any]:
    """Each case's ``verdict``; per drill asked for, its cases and verdict; the run's ``verdict`` and
    ``passed``. A case asked for with no result (the drill was cut short) fails, saying so."""
    for name in cases:
        report["cases"].setdefault(name, {"passed": False, "failures": ["did not run (the drill was cut short)"]})
    for item in report["cases"].values():
        item["verdict"] = case_verdict(item)
    report["drills"] = {}
    for drill, members in DRILLS.items():
        ran = [name for name in members if name in report["cases"]]
        if not ran:
            continue
        failing = [
            f"{name}: {report['cases'][name]['verdict'][6:]}" for name in ran if not report["cases"][name]["passed"]
        ]
        verdict = "PASS" if not failing else "FAIL: " + " | ".join(failing)
        report["drills"][drill] = {"cases": ran, "verdict": verdict}
    report["passed"] = all(item["passed"] for item in report["cases"].values())
    report["verdict"] = "PASS" if report["passed"] else "FAIL"
    return report


def lines(report: dict[str, Any]) -> list[str]:
    """What the drill prints last: one line per drill, then the overall verdict."""
    out = [f"{drill:22} {item['verdict']}" for drill, item in report["drills"].items()]
    return out + [f"host-memory drills: {report['verdict']}"]
