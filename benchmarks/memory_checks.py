"""The nightly memory comparison's checks: its thresholds file, each offload row's step-time floor, and the
verdict of every check against no offload.

The rows (memory_runs.RUN_FLAGS): ``baseline`` (no offload), ``step`` (the smallest footprint,
``--offload-prefetch step``), ``capped-no-offload`` (no offload under the cap, which must run out of memory),
``capped-default`` (``--offload-optimizer-states`` alone under the same cap, which must fit) and
``baseline-again`` (no offload once more, after them).

A row's floor: X bytes of state (the row's logged offloaded bytes) cross out and back each iteration, each
way over the link the row itself measured (X over its logged copy-out or copy-in time). Out, they leave after
the step and can hide behind the first micro-batch's forward, before its activation peak; back, the default
brings them during the last micro-batch's backward (hidden behind it, into memory it frees), while ``step``
brings them only into the step, hidden behind nothing. With a micro-batch's forward a third of its share of
no offload's iteration and its backward two thirds: floor = no offload's step time + max(0, X / out link -
forward) + max(0, X / in link - hidden return). No offload's step time there is the median over both no-offload
runs' steady iterations (the first alone where the second did not run through): they bracket the offload rows,
so a host whose pace drifts through the night moves the floor with it. A row passes when its median step time
is at most its floor times (1 + max_time_over_floor). The check's detail gives the row's and no offload's
quartiles too: single iterations of a host-bound loop spread, and a verdict near its threshold may be the machine's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from benchmarks.memory_report import GB, GIB, RunLog, copy_gbps, number
from benchmarks.memory_summary import RunSummary, pooled_step_ms

CAP_FLAG = "--offload-gpu-memory-cap-gib"
OFFLOAD_ROWS = ("step", "capped-default")  # the rows that move state, with a floor and bitwise losses
RETURN_HIDDEN = {"step": False, "capped-default": True}  # whether the state's return overlaps the last backward
AGAIN = "baseline-again"  # no offload after the offload rows, its losses bitwise too


@dataclass(frozen=True)
class Thresholds:
    """The nightly's pass/fail limits (configs/nightly_thresholds.yaml)."""

    min_step_peak_saving_of_state: float
    max_time_over_floor: float
    losses_equal: bool


class ThresholdsError(ValueError):
    """The thresholds file is not the strict mapping the nightly expects."""


def load_thresholds(path: str | Path) -> Thresholds:
    """Read the thresholds; unknown, missing or mistyped keys are errors, so a typo cannot relax a check."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ThresholdsError(f"{path}: {error}") from error
    if not isinstance(data, dict):
        raise ThresholdsError(f"{path}: expected a mapping of threshold names to values")
    names = [f.name for f in fields(Thresholds)]
    unknown, missing = sorted(set(data) - set(names)), [name for name in names if name not in data]
    if unknown or missing:
        raise ThresholdsError(f"{path}: unknown keys {unknown}, missing keys {missing}; allowed: {names}")
    for name in names:
        value, boolean = data[name], name == "losses_equal"
        if isinstance(value, bool) != boolean or not isinstance(value, (int, float)):
            raise ThresholdsError(f"{path}: {name} must be {'true or false' if boolean else 'a number'}")
    return Thresholds(**data)


def cap_gib(log: RunLog) -> float | None:
    """The --offload-gpu-memory-cap-gib a run ran under: from its command line, else its printed arguments."""
    words = (log.command or "").split()
    text = words[words.index(CAP_FLAG) + 1] if CAP_FLAG in words[:-1] else log.args.get("offload_gpu_memory_cap_gib")
    return number(text)


def micro_batches(log: RunLog) -> int | None:
    """Micro-batches per iteration on each rank: global batch / (micro-batch x data-parallel size)."""
    try:
        per_step = int(log.args["micro_batch_size"]) * int(log.args.get("data_parallel_size", 1))
        return max(int(log.args["global_batch_size"]) // per_step, 1)
    except (KeyError, ValueError, ZeroDivisionError):
        return None


@dataclass
class Check:
    """One check's outcome; ``passed`` is False too when the figure could not be measured."""

    name: str
    threshold: str
    measured: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class NoOffload:
    """No offload's step time for the floors (module docstring), its quartiles, how it was taken, and whether
    the second no-offload run ran through (then it counts, and its losses are compared too)."""

    median_ms: float | None
    quartiles: tuple[float, float] | None
    how: str
    again: bool = False


def no_offload(summaries: dict[str, RunSummary], logs: dict[str, RunLog]) -> NoOffload:
    """Both no-offload runs' steady iterations pooled where the second ran through, else the first run's."""
    base, again = summaries["baseline"], summaries.get(AGAIN)
    if base.status != "ok" or again is None or again.status != "ok" or again.median_step_ms is None:
        said = "" if base.median_step_ms is None else f"{base.median_step_ms:.1f} ms"
        return NoOffload(base.median_step_ms, base.quartile_step_ms, said)
    median, quartiles = pooled_step_ms([logs["baseline"], logs[AGAIN]])
    said = f"{median:.1f} ms ({base.median_step_ms:.1f} before the offload rows, {again.median_step_ms:.1f} after)"
    return NoOffload(median, quartiles, said, again=True)


def floor_of(name: str, row: RunSummary, base_ms: float | None, base_log: RunLog) -> dict[str, float | None]:
    """A row's floor (module docstring): the bytes that crossed, each way's link, the hidden compute, the floor."""
    crossed = (row.offloaded_gib or 0.0) * GIB

    out, back, parts = copy_gbps(crossed, row.copy_out_ms), copy_gbps(crossed, row.copy_in_ms), micro_batches(base_log)
    floor: dict[str, float | None] = {"crossed_gib": crossed / GIB, "link_out_gbps": out, "link_in_gbps": back}
    if base_ms is None or parts is None or (crossed and (out is None or back is None)):
        return floor | {"forward_ms": None, "return_hidden_ms": None, "floor_ms": None}
    forward = base_ms / parts / 3
    hidden = 2 * forward if RETURN_HIDDEN[name] else 0.0
    exposed = 0.0
    if crossed and out and back:
        exposed = max(0.0, crossed / (out * GB) * 1e3 - forward) + max(0.0, crossed / (back * GB) * 1e3 - hidden)
    return floor | {"forward_ms": forward, "return_hidden_ms": hidden, "floor_ms": base_ms + exposed}


def loss_difference(baseline: RunLog, other: RunLog) -> str:
    """Empty when both runs logged the same losses at the same iterations, else where they part."""
    if baseline.steps.keys() != other.steps.keys():
        return f"iterations differ: {sorted(baseline.steps.keys() ^ other.steps.keys())[:5]}"
    differing = [i for i in sorted(baseline.steps) if baseline.steps[i].loss != other.steps[i].loss]
    if not differing:
        return ""
    first = differing[0]
    return (
        f"{len(differing)} iterations differ, first {first}: "
        f"{baseline.steps[first].loss!r} vs {other.steps[first].loss!r}"
    )


def _unmeasured(name: str, threshold: str, why: str = "could not be measured from the logs") -> Check:
    return Check(name, threshold, "n/a", False, why)


def evaluate(
    summaries: dict[str, RunSummary],
    logs: dict[str, RunLog],
    state_bytes: int | None,
    cap: float | None,
    limits: Thresholds,
) -> tuple[dict[str, Any], list[Check]]:
    """The floors of the offload rows, and every check: (a) step's peak, (b) the cap (no offload runs out
    of memory, the default fits under it), each row's step time against its floor, then bitwise losses."""
    base, step = summaries["baseline"], summaries["step"]
    capped_none, capped = summaries["capped-no-offload"], summaries["capped-default"]
    state_gib = state_bytes / GIB if state_bytes else None
    base_time = no_offload(summaries, logs)
    floors = {name: floor_of(name, summaries[name], base_time.median_ms, logs["baseline"]) for name in OFFLOAD_ROWS}
    checks = []

    name, share = "step_peak_saving", limits.min_step_peak_saving_of_state
    threshold = f">= {share:g} x state" + (f" = {share * state_gib:.2f} GiB" if state_gib else "")
    if base.peak_gib is None or step.peak_gib is None or not state_gib:
        checks.append(_unmeasured(name, threshold))
    else:
        saved = base.peak_gib - step.peak_gib
        detail = f"peak allocated {base.peak_gib:.2f} -> {step.peak_gib:.2f} GiB; state {state_gib:.2f} GiB"
        checks.append(Check(name, threshold, f"{saved:.2f} GiB ({saved / state_gib:.3f} x state)",
                            saved >= share * state_gib, detail))  # fmt: skip

    name, threshold = "capped_no_offload_out_of_memory", f"out of memory under {cap or '?'} GiB"
    detail = capped_none.detail or "it ran through: the cap forces nothing off the GPU"
    checks.append(Check(name, threshold, capped_none.status, capped_none.status == "out of memory", detail))

    name, threshold = "capped_default_fits", f"ran through, peak reserved <= {cap or '?'} GiB"
    if cap is None:
        checks.append(_unmeasured(name, threshold, "no cap in the capped-default log"))
    elif capped.status != "ok" or capped.max_reserved_gib is None:
        checks.append(Check(name, threshold, capped.status, False, capped.detail or "no memory lines"))
    else:
        fits = capped.max_reserved_gib <= cap
        checks.append(Check(name, threshold, f"{capped.max_reserved_gib:.2f} GiB", fits,
                            f"offloaded {capped.offloaded_gib or 0:.2f} GiB per rank"))  # fmt: skip

    for row in OFFLOAD_ROWS:
        name, floor, ms = f"step_time_{row.replace('-', '_')}", floors[row], summaries[row].median_step_ms
        if floor["floor_ms"] is None or ms is None:
            checks.append(_unmeasured(name, f"<= floor x {1 + limits.max_time_over_floor:g}"))
            continue
        limit = floor["floor_ms"] * (1 + limits.max_time_over_floor)
        floor["threshold_ms"] = limit
        links = (
            f"out {floor['link_out_gbps']:.1f}, back {floor['link_in_gbps']:.1f} GB/s" if floor["crossed_gib"] else ""
        )
        detail = (f"floor {floor['floor_ms']:.1f} ms: no offload {base_time.how} + "
                  f"{floor['crossed_gib']:.2f} GiB {links or 'none moved'}, less forward {floor['forward_ms']:.1f} ms "
                  f"and return hidden {floor['return_hidden_ms']:.1f} ms")  # fmt: skip
        spreads = [summaries[row].quartile_step_ms, base_time.quartiles]
        if all(spreads):  # single iterations spread: a verdict near its threshold may be the machine's
            detail += "; quartiles {:.0f}-{:.0f} ms, no offload's {:.0f}-{:.0f}".format(*spreads[0], *spreads[1])
        checks.append(Check(name, f"<= {limit:.1f} ms", f"{ms:.1f} ms", ms <= limit, detail))

    if limits.losses_equal:
        for row in OFFLOAD_ROWS + ((AGAIN,) if base_time.again else ()):  # a second run that stopped: no losses
            text = loss_difference(logs["baseline"], logs[row])
            checks.append(Check(f"losses_equal_{row.replace('-', '_')}", "bitwise as no offload",
                                "differ" if text else "identical", not text, text))  # fmt: skip
    measured = {"state_gib": state_gib, "cap_gib": cap, "floors": floors, "no_offload_ms": base_time.median_ms}
    return measured, checks
