"""The host-memory drills in Megatron-LM's loop (host_memory_drill.py's ``--megatron`` children under torchrun,
scripts/pretrain_gpt.py with configs/tiny.yaml): pinning refused, a node too small for its ranks (with the check
and without), and the host short during a checkpoint save, then the run resumed from the last complete one."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

from benchmarks.memory_report import last_error_line
from tests.drills import drill_checkpoints, drill_runs
from tests.drills.crash_verdict import Verdict, judge, logged_differences
from tests.gpu.host_memory_surface import address_space_capped, refuse_pinning
from tests.gpu.host_memory_verdicts import one_line

__all__ = [
    "host_short_during_save",
    "node_too_small",
    "node_too_small_check_off",
    "pin_refused_megatron",
    "resume_verdict",
    "run_in_megatron",
]

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", "configs/tiny.yaml", "--offload-optimizer-states"]
RANKS = 4096  # node-too-small: the real MemAvailable, shared as if by this many ranks
SAVE_INTERVAL, SHORT_AT = 5, 10  # host-short-during-save: saves at 5 and 10, the one at 10 refused
RUN_BOUND_S = 150.0
DRILL_LINE = "megatron-offload host-memory drill:"
MODEL_BUILT = re.compile(r"number of parameters on \(")  # Megatron's line once the model is built
HOST_REFUSED = "can't allocate memory"  # torch's CPU allocator, when the OS refuses


def refuse_host_memory_at_save(nth: int) -> None:
    """The ``nth`` checkpoint save stages its tensors (unpinned) with the address space capped at what
    this process holds: the C allocator's real refusal, inside Megatron's own save."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors
    saves = [0]

    def preload_then_maybe_refuse(write_buckets: Any, non_blocking: bool = True) -> Any:
        saves[0] += 1
        if saves[0] != nth:
            return preload(write_buckets, non_blocking)
        print(f"{DRILL_LINE} save {nth}: host memory capped at what the process holds (RLIMIT_AS)", flush=True)
        with address_space_capped(margin=8 * 2**20):
            return preload(write_buckets, False)

    FileSystemWriterAsync.preload_tensors = staticmethod(preload_then_maybe_refuse)


def run_in_megatron(name: str) -> None:
    from megatron_offload.core import host_memory

    if name == "pin-refused-megatron":
        host_memory._pin = refuse_pinning
    elif name.startswith("node-too-small"):
        host_memory.ranks_on_this_node = lambda: RANKS  # the real MemAvailable, shared as if by RANKS ranks
    elif name.startswith("host-short-during-save"):  # with offloading, and its control without
        refuse_host_memory_at_save(SHORT_AT // SAVE_INTERVAL)
    runpy.run_path(str(ROOT / "scripts" / "pretrain_gpt.py"))["main"]()  # as users run it: --config expanded


def megatron_run(name: str, args: list[str], out: Path, offload: bool = True) -> tuple[drill_runs.Outcome, list[str]]:
    """One bounded torchrun of this file with ``--megatron NAME``: how it ended, and a failure if stopped."""
    tiny = TINY if offload else [arg for arg in TINY if arg != "--offload-optimizer-states"]
    command = [*drill_runs.torchrun(1), "-m", "tests.gpu.host_memory_drill", "--megatron", name, *tiny, *args]
    outcome = drill_runs.run_bounded(command, out / f"host-memory-{name}.log", bound_s=RUN_BOUND_S, cwd=ROOT)
    print(f"[{name}] {'stopped: ' + outcome.stopped if outcome.stopped else f'exit {outcome.returncode}'}", flush=True)
    return outcome, [drill_runs.verdict(name, outcome)] if outcome.stopped else []


def line_with(text: str, *needles: str) -> str:
    """The first log line holding every needle (what the user reads), else the run's telling last line."""
    found = next((line.strip() for line in text.splitlines() if all(n in line for n in needles)), None)
    return re.sub(r"^\[rank\d+\]:\s*", "", found) if found else last_error_line(text)


def worker_part(text: str) -> str:
    """The log up to torchrun's own report of a failed worker (whose traceback is torchrun's, not the user's)."""
    return re.split(r".*elastic/multiprocessing/api\.py.*failed \(exitcode", text, maxsplit=1)[0]


def pin_refused_megatron(out: Path) -> tuple[list[str], str, dict]:
    outcome, failures = megatron_run("pin-refused-megatron", ["--train-iters", "5"], out)
    text = outcome.text
    intact = {"last_iteration": drill_runs.last_iteration(text)}
    if not failures and outcome.returncode != 0:
        failures.append(f"exited {outcome.returncode}: {last_error_line(text)}")
    if "using pageable memory instead" not in text:
        failures.append("no warning that pinning was refused")
    failures += one_line(line_with(text, "could not pin"), "the warning")
    if intact["last_iteration"] != 5:
        failures.append(f"the run did not reach iteration 5 ({intact['last_iteration']})")
    return failures, line_with(text, "could not pin"), intact


def node_too_small(out: Path) -> tuple[list[str], str, dict]:
    outcome, failures = megatron_run("node-too-small", ["--train-iters", "5"], out)
    text = outcome.text
    message = line_with(text, "rank(s) on this node")
    intact = {
        "model_built_before_refusal": bool(MODEL_BUILT.search(text)),
        "iterations_run": drill_runs.last_iteration(text),
        "traceback_shown": "Traceback (most recent call last)" in worker_part(text),
    }
    if not failures and outcome.returncode == 0:
        failures.append("the run was not refused")
    for needle in (f"x {RANKS} rank(s) on this node", "GiB of host memory per rank", "GiB is available"):
        if needle not in message:
            failures.append(f"the message lacks {needle!r}")
    if "--no-offload-host-memory-check" not in message:
        failures.append("the message does not name --no-offload-host-memory-check")
    if intact["iterations_run"] is not None:
        failures.append(f"refused only after iteration {intact['iterations_run']}")
    if intact["model_built_before_refusal"]:
        failures.append("refused only after the model was built (Megatron's parameter count is in the log)")
    if intact["traceback_shown"]:
        failures.append("the refusal came with a traceback, not one line")
    return failures, message, intact


def node_too_small_check_off(out: Path) -> tuple[list[str], str, dict]:
    # 3 iterations: tiny.yaml's 2 warm-up iterations must be fewer than the run's (Megatron asserts so).
    args = ["--train-iters", "3", "--no-offload-host-memory-check"]
    outcome, failures = megatron_run("node-too-small-check-off", args, out)
    intact = {"last_iteration": drill_runs.last_iteration(outcome.text)}
    if not failures and (outcome.returncode != 0 or intact["last_iteration"] != 3):
        failures.append(f"with the check off the run did not train 3 iterations: {last_error_line(outcome.text)}")
    return failures, "", intact


def refused_then_resumed(
    out: Path, scratch: Path, offload: bool
) -> tuple[list[str], drill_runs.Outcome, drill_runs.Outcome, dict[str, Any]]:
    """The run whose save of iteration 10 is refused, then a new run resumed from what it left: the
    failures of their own checks (refusal, tracker, cut-short save, what the resume loaded), both runs,
    and what was checked."""
    side = "" if offload else "-control"
    save = scratch / f"host-short{side}"
    ckpt = ["--ckpt-format", "torch_dist", "--train-iters", str(SHORT_AT)]
    args = [*ckpt, "--save", str(save), "--save-interval", str(SAVE_INTERVAL)]
    refused, failures = megatron_run(f"host-short-during-save{side}", args, out, offload)
    text = refused.text
    last = SHORT_AT - SAVE_INTERVAL
    intact: dict[str, Any] = {
        "tracker": drill_checkpoints.last_complete_iteration(save),
        "tracked_save_complete": drill_checkpoints.is_complete(save / f"iter_{last:07d}"),
        "cut_short": drill_checkpoints.cut_short(save),
    }
    if not failures and refused.returncode == 0:
        failures.append("the run ended well: the host's refusal was not provoked")
    if HOST_REFUSED not in text:
        failures.append(f"no {HOST_REFUSED!r} in the log")
    if drill_runs.last_iteration(text) != SHORT_AT:
        failures.append(f"the run did not reach iteration {SHORT_AT} before its save")
    if intact["tracker"] != last or not intact["tracked_save_complete"]:
        failures.append(f"the tracker names {intact['tracker']}, not the complete save of iteration {last}")
    if (save / f"iter_{SHORT_AT:07d}").exists() and f"iter_{SHORT_AT:07d}" not in intact["cut_short"]:
        failures.append(f"the refused save of iteration {SHORT_AT} looks complete")
    resumed, resume_failures = megatron_run(f"host-short-resumed{side}", [*ckpt, "--load", str(save)], out, offload)
    failures += resume_failures
    intact["resumed_loaded"] = [
        int(i) for i in re.findall(r"successfully loaded checkpoint .* at iteration (\d+)", resumed.text)
    ]
    if intact["resumed_loaded"] != [last]:
        failures.append(f"the resumed run loaded {intact['resumed_loaded']}, not iteration {last}")
    logged = sorted(drill_checkpoints.losses_and_grad_norms(resumed.text))
    if logged != RESUMED:
        failures.append(f"the resumed run logged iterations {logged}, not {RESUMED}")
    return [f"{f} (without offloading)" if not offload else f for f in failures], refused, resumed, intact


RESUMED = list(range(SHORT_AT - SAVE_INTERVAL + 1, SHORT_AT + 1))  # the iterations the resumed run repeats


def resume_verdict(ours: tuple[str, str], control: tuple[str, str] | None) -> Verdict:
    """The resumed run's logged losses and grad norms against the refused run's, bitwise as printed, each
    difference sorted by the control's (the same two runs without offloading; None: none to ask)."""
    differences = logged_differences(*ours, RESUMED)
    return judge(differences, None if control is None else logged_differences(*control, RESUMED))


def host_short_during_save(out: Path, scratch: Path) -> tuple[list[str], str, dict]:
    failures, refused, resumed, intact = refused_then_resumed(out, scratch, offload=True)
    control_failures, control_refused, control_resumed, intact["control"] = refused_then_resumed(
        out, scratch, offload=False
    )
    # A control that did not refuse and resume as asked cannot tell whose a difference is.
    control = None if control_failures else (control_refused.text, control_resumed.text)
    verdict = resume_verdict((refused.text, resumed.text), control)
    intact["resume"] = verdict.status
    intact["megatron_core_differences"] = verdict.megatron_core
    intact["control_only_differences"] = verdict.control_only
    intact["control_failures"] = control_failures
    return failures + verdict.failures, line_with(refused.text, HOST_REFUSED), intact
