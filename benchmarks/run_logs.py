"""What a failed training job's log says, in one line, for the benchmarks that run Megatron jobs.

A job run under ``torch.distributed.run`` that fails ends with torchrun's own report: its traceback
(``ChildFailedError``), lines of ``=`` and ``-`` and a "Root Cause" block without the cause. The reason is
in the job's own output before that: its last Python exception, or the one line our launcher prints
when nothing can start (no CUDA GPU, no ``megatron.training``, a bad config file).
"""

from __future__ import annotations

import re

__all__ = ["did_not_fit", "failure_reason", "logged_link_gbps"]

_EXCEPTION = re.compile(r"\b(?:\w+\.)*\w*(?:Error|Exception)(?:: \S|$)")  # "...Error: message" or a bare one
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s*")
# torchrun's agent line that opens its failure report: "E1125 05:37:02.394000 7127 .../api.py:1002] failed"
_AGENT_FAILED = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S+\] failed \(exitcode")
_AGENT_LINE = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S+\] ")
# c10's log lines on the way out: "[W1128 20:34:00.545485184 ProcessGroupNCCL.cpp:1575] Warning: ..."
_C10_LINE = re.compile(r"^\[[EWI]\d{4} [\d:.]+ ")
_SEPARATOR = re.compile(r"^[\s=\-*_#]*$")
# A link speed a job logs, as a Megatron-style field ("... link ... (GB/s): 52.3") or a line "link: 52.3 GB/s"
_LINK = re.compile(r"\blink\b[^|:\n]*(?:\(GB/s\))?:\s*([\d.]+)(?:\s*GB/s)?", re.IGNORECASE)
_NOT_FIT = re.compile(r"OutOfMemoryError|out of (?:GPU )?memory|OffloadFitError|cannot fit|does not fit", re.IGNORECASE)


def _own_lines(text: str) -> list[str]:
    """The job's own non-empty lines: torchrun's failure report and agent lines dropped, rank prefixes off."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if _AGENT_FAILED.match(line.strip()):
            lines = lines[:index]
            break
    own = [_RANK_PREFIX.sub("", line.strip()) for line in lines]
    return [
        line
        for line in own
        if line
        and not _SEPARATOR.match(line)
        and not _AGENT_LINE.match(line)
        and not _C10_LINE.match(line)
        and not line.startswith("$ ")
    ]


def failure_reason(text: str) -> str:
    """The most telling line of a failed job's log: its last exception (not torchrun's ChildFailedError),
    else its last meaningful line (never a separator nor the command the log opens with), else torchrun's
    "SCRIPT FAILED", else "empty log"."""
    lines = _own_lines(text)
    exceptions = [line for line in lines if _EXCEPTION.search(line) and "ChildFailedError" not in line]
    if exceptions:
        return exceptions[-1][:300]
    if lines:
        return lines[-1][:300]
    rest = [line.strip() for line in text.splitlines() if line.strip() and not _SEPARATOR.match(line)]
    failed = [line for line in rest if line.endswith(" FAILED")]  # torchrun's "SCRIPT FAILED": nothing better
    return (failed or rest or ["empty log"])[-1][:300]


def did_not_fit(reason: str) -> bool:
    """Whether a failure reason says the job ran out of GPU memory (or was refused as one that cannot fit)."""
    return bool(_NOT_FIT.search(reason))


def logged_link_gbps(text: str) -> float | None:
    """The last host link speed (GB/s) a job's log states, if it states one (in a field or line that names
    the link and GB/s); None when it states none."""
    found = [m for m in _LINK.finditer(text) if "GB/s" in text[m.start() : m.end() + 8] or "(GB/s)" in m[0]]
    try:
        return float(found[-1][1]) if found else None
    except ValueError:
        return None
