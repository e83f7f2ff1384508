"""The Megatron-LM log reader of the nightly memory comparison: iterations, memory lines, arguments, their
per-iteration columns and the state size (each run's summary is in memory_summary.py, the checks in
memory_checks.py, the Markdown page in memory_markdown.py).

Pure Python (no torch, no megatron_offload), so ``compare_memory.py --from-logs`` and the CPU tests can
regenerate a report anywhere from the logs a GPU run left behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

MIB = 1024**2
GIB = 1024**3
GB = 1e9


def copy_gbps(nbytes: float | None, ms: float | None) -> float | None:
    """The link a run's copies measured, in GB/s: the bytes it logged as moved over the copy time it logged;
    None where it moved nothing or logged no time."""
    return nbytes / (ms * 1e-3) / GB if nbytes and ms else None


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
    allocator_retries: int | None = None  # the caching allocator's retries under the limit since the last line
    streamed_gib: float | None = None  # state that came back through the step, not ahead of it (per step)


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


def number(text: str | None) -> float | None:
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
                loss=number(values.get("lm loss")),
                step_ms=number(values.get("elapsed time per iteration (ms)")),
                offloaded_gib=number(values.get("offloaded per rank (GiB)")),
                copy_out_ms=number(copies[0]) if len(copies) == 2 else None,
                copy_in_ms=number(copies[1]) if len(copies) == 2 else None,
                exposed_ms=number(values.get("offload exposed (ms)")),
                peak_allocated_gib=number(peaks[0]) if len(peaks) == 2 else None,
                peak_reserved_gib=number(peaks[1]) if len(peaks) == 2 else None,
                allocator_retries=int(values["allocator retries"]) if "allocator retries" in values else None,
                streamed_gib=number(values.get("offload streamed in step (GiB)")),
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
