"""Log parsing, figures, thresholds and the Markdown report of the nightly memory comparison.

Pure Python plus PyYAML (no torch, no megatron_offload), so ``compare_memory.py --from-logs`` and the
CPU tests can regenerate a report anywhere from the logs a GPU run left behind.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

MIB = 1024**2
GIB = 1024**3
WARMUP_ITERATIONS = 2  # start-up allocations and kernel autotuning land in the first iterations

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|(.*)")
_MEMORY = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \|(.*)")
_PARAMETERS = re.compile(r"number of parameters on \(([^)]*)\) model parallel rank \(([^)]*)\): (\d+)")
_ARGUMENT = re.compile(r"^\s+(\w+) \.+ (.*?)\s*$")
_EXCEPTION = re.compile(r"\b(?:\w+\.)*\w*(?:Error|Exception)(?:: \S|$)")  # "...Error: message" or a bare one


@dataclass
class Step:
    """One iteration line (the offload fields only in runs with --offload-optimizer-states)."""

    loss: float | None
    step_ms: float | None
    offloaded_gib: float | None = None
    copy_out_ms: float | None = None
    copy_in_ms: float | None = None
    exposed_ms: float | None = None
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None


@dataclass
class Memory:
    """One ``memory (MB)`` line; Megatron divides by 2**20, so the values are MiB."""

    allocated: float
    max_allocated: float
    reserved: float
    max_reserved: float


@dataclass
class RunLog:
    """Everything the report reads from one run's log."""

    steps: dict[int, Step] = field(default_factory=dict)
    memory: dict[int, dict[int, Memory]] = field(default_factory=dict)  # rank -> iteration -> line
    args: dict[str, str] = field(default_factory=dict)
    parameters: dict[str, int] = field(default_factory=dict)  # "(tensor, ..., pipeline) ranks" -> count
    train_iters: int | None = None
    command: str | None = None  # the "$ ..." first line compare_memory.py writes
    error: str | None = None

    @property
    def memory_rank(self) -> int | None:
        """The highest rank that printed memory: nearest to the last rank, which prints the offload fields."""
        return max(self.memory, default=None)


def _fields(text: str) -> dict[str, str]:
    """Megatron's ``name: value |`` fields of one line."""
    pairs = (part.partition(": ") for part in text.split("|"))
    return {name.strip(): value.strip() for name, sep, value in pairs if sep}


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def last_error_line(text: str) -> str:
    """The most telling line of a failed run: its last Python exception, else its last non-empty line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in text.splitlines() if line.strip()]
    exceptions = [line for line in lines if _EXCEPTION.search(line) and "ChildFailedError" not in line]
    return (exceptions or lines or ["empty log"])[-1][:300]


def parse_log(text: str) -> RunLog:
    """Iterations, memory lines, printed arguments and parameter counts of one Megatron-LM log."""
    log = RunLog()
    in_arguments = False
    for line in text.splitlines():
        if line.startswith("$ ") and log.command is None:
            log.command = line[2:]
        elif "------------------------ arguments ------------------------" in line:
            in_arguments = True
        elif "end of arguments" in line:
            in_arguments = False
        elif in_arguments and (match := _ARGUMENT.match(line)):
            log.args[match[1]] = match[2]
        elif match := _ITERATION.search(line):
            values = _fields(match[3])
            copies = values.get("offload copy out/in (ms)", "").split("/")
            peaks = values.get("mem peak allocated/reserved (GiB)", "").split("/")
            log.train_iters = int(match[2])
            log.steps[int(match[1])] = Step(
                loss=_number(values.get("lm loss")),
                step_ms=_number(values.get("elapsed time per iteration (ms)")),
                offloaded_gib=_number(values.get("offloaded per rank (GiB)")),
                copy_out_ms=_number(copies[0]) if len(copies) == 2 else None,
                copy_in_ms=_number(copies[1]) if len(copies) == 2 else None,
                exposed_ms=_number(values.get("offload exposed (ms)")),
                peak_allocated_gib=_number(peaks[0]) if len(peaks) == 2 else None,
                peak_reserved_gib=_number(peaks[1]) if len(peaks) == 2 else None,
            )
        elif match := _MEMORY.search(line):
            values = {name: float(value) for name, value in _fields(match[3]).items()}
            names = ("allocated", "max allocated", "reserved", "max reserved")
            log.memory.setdefault(int(match[1]), {})[int(match[2])] = Memory(*(values[name] for name in names))
        elif match := _PARAMETERS.search(line):
            log.parameters[match[2]] = int(match[3])
    return log


def series(log: RunLog) -> dict[str, list[Any]]:
    """Per-iteration columns for report.json: the iteration lines, and the memory lines of ``memory_rank``."""
    iterations = sorted(log.steps)
    columns: dict[str, list[Any]] = {"iteration": iterations}
    for name in ("loss", "step_ms", "offloaded_gib", "copy_out_ms", "copy_in_ms", "exposed_ms"):
        columns[name] = [getattr(log.steps[i], name) for i in iterations]
    memory = log.memory.get(log.memory_rank, {}) if log.memory_rank is not None else {}
    columns["memory_iteration"] = sorted(memory)
    for name in ("allocated", "max_allocated", "reserved", "max_reserved"):
        columns[f"{name}_mib"] = [getattr(memory[i], name) for i in sorted(memory)]
    return columns


def config_of(command: str | None) -> str | None:
    """The --config of a logged command line (for --from-logs without run_info.json)."""
    words = (command or "").split()
    return words[words.index("--config") + 1] if "--config" in words[:-1] else None


def _median(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


@dataclass
class RunSummary:
    """The figures of one run that the table, the plots and the checks use."""

    status: str  # "ok", "failed" or "not available"
    detail: str = ""
    iterations: int = 0
    median_step_ms: float | None = None
    allocated_gib: float | None = None  # median "allocated" between steps, after the warm-up
    peak_gib: float | None = None  # "max allocated" at the last iteration
    max_reserved_gib: float | None = None  # "max reserved" at the last iteration
    offloaded_gib: float | None = None
    exposed_ms: float | None = None
    copy_out_ms: float | None = None
    copy_in_ms: float | None = None
    final_loss: float | None = None
    memory_rank: int | None = None


def _steady(iterations: list[int]) -> list[int]:
    later = [i for i in sorted(iterations) if i > WARMUP_ITERATIONS]
    return later or sorted(iterations)


def summarize(log: RunLog) -> RunSummary:
    """Medians after the warm-up, peaks at the last iteration; "failed" when the run did not finish."""
    if not log.steps:
        return RunSummary("failed", log.error or "no iteration lines in the log")
    last = max(log.steps)
    if log.error or (log.train_iters is not None and last < log.train_iters):
        return RunSummary("failed", log.error or f"stopped at iteration {last} of {log.train_iters}")
    steps = [log.steps[i] for i in _steady(list(log.steps))]
    summary = RunSummary(
        "ok",
        iterations=len(log.steps),
        median_step_ms=_median([s.step_ms for s in steps]),
        offloaded_gib=log.steps[last].offloaded_gib,
        exposed_ms=_median([s.exposed_ms for s in steps]),
        copy_out_ms=_median([s.copy_out_ms for s in steps]),
        copy_in_ms=_median([s.copy_in_ms for s in steps]),
        final_loss=log.steps[last].loss,
        memory_rank=log.memory_rank,
    )
    if log.memory_rank is not None:
        memory = log.memory[log.memory_rank]
        summary.allocated_gib = _median([memory[i].allocated * MIB / GIB for i in _steady(list(memory))])
        summary.peak_gib = memory[max(memory)].max_allocated * MIB / GIB
        summary.max_reserved_gib = memory[max(memory)].max_reserved * MIB / GIB
    return summary


def read_runs(
    source: Path, names: list[str], required: tuple[str, ...], runs_info: dict[str, Any]
) -> tuple[dict[str, RunLog], dict[str, RunSummary]]:
    """Parse and summarize ``source/<name>.log`` of each run; a reference run that failed is "not available".

    ``runs_info`` holds each run's recorded ``returncode`` (run_info.json); a reference run with neither a
    log nor a record was skipped and is left out.
    """
    logs: dict[str, RunLog] = {}
    summaries: dict[str, RunSummary] = {}
    for name in names:
        path = source / f"{name}.log"
        if not path.is_file() and name not in required and name not in runs_info:
            continue
        text = path.read_text(errors="replace") if path.is_file() else ""
        logs[name] = parse_log(text)
        if not path.is_file():
            logs[name].error = f"no log {path.name}"
        elif runs_info.get(name, {}).get("returncode", 0) != 0:
            logs[name].error = f"exit {runs_info[name]['returncode']}: {last_error_line(text)}"
        summaries[name] = summarize(logs[name])
        if name not in required and summaries[name].status != "ok":
            summaries[name].status = "not available"
            summaries[name].detail = logs[name].error or last_error_line(text)
    return logs, summaries


def expected_state_bytes(log: RunLog, master_weights: bool) -> tuple[int | None, str]:
    """Optimizer state per rank, 12 bytes per parameter shard (8 without master weights), and how.

    Megatron prints the parameters of each (tensor, [gtp,] pipeline) model-parallel rank (from its data
    and context parallel rank 0); the distributed optimizer shards each of those over the data x context
    parallel ranks. With every model-parallel rank printed this is 12 x parameters / world size, the
    parameters counted as stored (TP-replicated norms once per TP rank). MoE expert sharding is not modelled.
    """
    if not log.parameters:
        return None, "no 'number of parameters' line in the log"
    model = [int(log.args.get(f"{name}_parallel_size", 1)) for name in ("tensor_model", "pipeline_model", "context")]
    world = int(log.args.get("world_size", 1))
    data = int(log.args.get("data_parallel_size", 0)) or max(world // (model[0] * model[1] * model[2]), 1)
    counts = list(log.parameters.values())
    per_param, shards = (12 if master_weights else 8), data * model[2]
    how = (
        f"{per_param} bytes x {sum(counts) / len(counts):,.0f} parameters per model-parallel rank (mean of "
        f"{len(counts)} printed, {sum(counts):,} in all; tp {model[0]} x pp {model[1]}) / {shards} shards "
        f"(dp {data} x cp {model[2]})"
    )
    return per_param * sum(counts) // (len(counts) * shards), how


@dataclass(frozen=True)
class Thresholds:
    """The nightly's pass/fail limits (configs/nightly_thresholds.yaml)."""

    min_saving_fraction: float
    min_peak_saving_gib: float
    max_step_time_overhead: float
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


@dataclass
class Check:
    """One threshold's outcome; ``passed`` is False too when the figure could not be measured."""

    name: str
    threshold: str
    measured: str
    passed: bool
    detail: str = ""


def _loss_difference(baseline: RunLog, offload: RunLog) -> str:
    """Empty when both runs logged the same losses at the same iterations, else where they part."""
    if baseline.steps.keys() != offload.steps.keys():
        return f"iterations differ: {sorted(baseline.steps.keys() ^ offload.steps.keys())[:5]}"
    differing = [i for i in sorted(baseline.steps) if baseline.steps[i].loss != offload.steps[i].loss]
    if not differing:
        return ""
    first = differing[0]
    return (
        f"{len(differing)} iterations differ, first {first}: "
        f"{baseline.steps[first].loss!r} vs {offload.steps[first].loss!r}"
    )


def evaluate(
    summaries: dict[str, RunSummary], logs: dict[str, RunLog], expected_bytes: int | None, limits: Thresholds
) -> tuple[dict[str, Any], list[Check]]:
    """Measured savings of the offload run against the baseline, and every threshold's check."""
    base, off = summaries["baseline"], summaries["offload"]

    def difference(name: str) -> float | None:
        a, b = getattr(base, name), getattr(off, name)
        return a - b if a is not None and b is not None else None

    saving_gib, peak_saving_gib = difference("allocated_gib"), difference("peak_gib")
    fraction = saving_gib * GIB / expected_bytes if saving_gib is not None and expected_bytes else None
    overhead = off.median_step_ms / base.median_step_ms - 1 if off.median_step_ms and base.median_step_ms else None
    measured = {
        "expected_gib": expected_bytes / GIB if expected_bytes else None,
        "allocated_saving_gib": saving_gib,
        "saving_fraction": fraction,
        "peak_saving_gib": peak_saving_gib,
        "step_time_overhead": overhead,
        "offloaded_gib_logged": off.offloaded_gib,
    }

    def check(name: str, value: float | None, passes: bool, threshold: str, shown: str, detail: str = "") -> Check:
        if value is None:
            return Check(name, threshold, "n/a", False, "could not be measured from the logs")
        return Check(name, threshold, shown.format(value), passes, detail)

    expected_gib = measured["expected_gib"]
    checks = [
        check(
            "min_saving_fraction",
            fraction,
            fraction is not None and fraction >= limits.min_saving_fraction,
            f">= {limits.min_saving_fraction}",
            "{:.3f}",
            f"{saving_gib:.2f} of {expected_gib:.2f} GiB expected" if fraction is not None else "",
        ),
        check(
            "min_peak_saving_gib",
            peak_saving_gib,
            peak_saving_gib is not None and peak_saving_gib >= limits.min_peak_saving_gib,
            f">= {limits.min_peak_saving_gib} GiB",
            "{:.2f} GiB",
        ),
        check(
            "max_step_time_overhead",
            overhead,
            overhead is not None and overhead <= limits.max_step_time_overhead,
            f"<= {limits.max_step_time_overhead:+.0%}",
            "{:+.1%}",
        ),
    ]
    if limits.losses_equal:
        difference_text = _loss_difference(logs["baseline"], logs["offload"])
        checks.append(Check("losses_equal", "identical", "identical" if not difference_text else "differ",
                            not difference_text, difference_text))  # fmt: skip
    return measured, checks


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def render_markdown(report: dict[str, Any]) -> str:
    """The human page: one row per run, expected vs measured saving, each threshold, then the notes."""
    env, runs, saving = report["environment"], report["runs"], report["saving"]
    base_ms = runs["baseline"]["summary"]["median_step_ms"]
    lines = [
        "# Nightly memory comparison",
        "",
        f"On {env.get('device') or 'an unknown device'} ({report['gpus']} GPU), torch {env.get('torch')}, "
        f"megatron-core {env.get('megatron_core')}, commit {env.get('commit')}; config `{report['config']}`; "
        f"medians over the iterations after the first {WARMUP_ITERATIONS}, peaks at the last iteration.",
        "",
        "| run | status | median step ms | overhead vs baseline | allocated between steps GiB | peak allocated "
        "GiB | peak reserved GiB | offloaded GiB/rank | exposed ms | final loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, run in runs.items():
        s = run["summary"]
        status = s["status"] if s["status"] == "ok" else f"{s['status']}: {s['detail']}".replace("|", "/")
        overhead = s["median_step_ms"] / base_ms - 1 if s["median_step_ms"] and base_ms else None
        lines.append(
            f"| {name} | {status} | {_cell(s['median_step_ms'], '.1f')} | {_cell(overhead, '+.1%')} | "
            f"{_cell(s['allocated_gib'], '.2f')} | {_cell(s['peak_gib'], '.2f')} | "
            f"{_cell(s['max_reserved_gib'], '.2f')} | {_cell(s['offloaded_gib'], '.2f')} | "
            f"{_cell(s['exposed_ms'], '.1f')} | {_cell(s['final_loss'], '.6E')} |"
        )
    expected = saving["expected_gib"]
    lines += [
        "",
        "## Expected vs measured saving (offload vs baseline, per rank)",
        "",
        f"Expected: {saving['expected_how']}.",
        "",
        "| figure | expected GiB | measured GiB | measured / expected |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, key in [("allocated between steps", "allocated_saving_gib"), ("peak allocated", "peak_saving_gib"),
                       ("offloaded per rank (log line)", "offloaded_gib_logged")]:  # fmt: skip
        value = saving[key]
        ratio = value / expected if value is not None and expected else None
        lines.append(f"| {label} | {_cell(expected, '.2f')} | {_cell(value, '.2f')} | {_cell(ratio, '.3f')} |")
    lines += [
        "",
        "## Thresholds",
        "",
        "| check | threshold | measured | result | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in report["checks"]:
        result = "PASS" if c["passed"] else "FAIL"
        lines.append(f"| {c['name']} | {c['threshold']} | {c['measured']} | {result} | {c['detail']} |")
    lines += ["", f"**Overall: {report['verdict']}**", ""]
    if report["notes"]:
        lines += ["## Notes", "", *(f"- {note}" for note in report["notes"]), ""]
    return "\n".join(lines)
