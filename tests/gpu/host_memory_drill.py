"""Host-memory drills on a GPU machine (the CPU suite runs their library side in tests/test_host_memory.py):

    python -m tests.gpu.host_memory_drill --out results/host-memory     # exit 0 when every case passed
    python -m tests.gpu.host_memory_drill --out DIR --only short-at-start   # one drill (or named cases)

The drills (host_memory_verdicts.DRILLS): ``short-at-start`` (cases 3, 5), ``short-while-pinning`` (1, 2,
4), ``short-during-save`` (6). ``DIR/host-memory.json`` holds each case (whether it passed, its failures,
its ``verdict`` line, the message as the user sees it: the warning or the error line of the log, what was
checked to be intact, its seconds and its log), each drill's verdict and the run's ``verdict``; the
drill prints one line per drill last. Every child runs under drill_runs.run_bounded: a case that hangs
ends with a verdict, never a wait.

Through the library API, in one child (``--api``; tests/gpu/harness.py's bf16 GPT on one GPU, 67M params):
1. ``slab-pinned``: a HostSlab of 256 MiB is pinned here; ``slab-pin-refused-raises``: with pinning refused,
   ``on_pin_failure="raise"`` is a HostMemoryError naming the bytes.
2. ``pin-refused-at-attach``: cudaHostRegister answers 2 (out of memory) to the offloader's slab at attach.
   The user is told at attach (a warning with the measured cost of pageable copies, or a HostMemoryError),
   and nothing is lost: training on goes bitwise as without offloading (or, after an error, nothing is
   left half set up).
3. ``allocation-refused-at-attach``: the host refuses the slab's allocation itself (the process's address
   space capped at what it holds, RLIMIT_AS, around ``attach_offloader`` only): a HostMemoryError, and
   nothing half set up: no wrapper, hook or attribute left on the optimizer and model, the fp32 masters
   untouched, a second attach works, and training then matches training without offloading bitwise.
In Megatron-LM's loop (scripts/pretrain_gpt.py, configs/tiny.yaml; each case this module again under torchrun
with ``--megatron CASE``, which makes the change on module attributes, never in library code):
4. ``pin-refused-megatron``: the same refusal; the run completes, its log carries the warning.
5. ``node-too-small``: the real MemAvailable, as if 4096 ranks shared this node: refused before the model
   is built (Megatron's parameter-count line absent) and before iteration 1, naming the bytes per rank,
   the ranks, what is available and ``--no-offload-host-memory-check``;
   ``node-too-small-check-off``: the same node with that flag trains (3 iterations).
6. ``host-short-during-save``: the library pins its host memory once, at attach (the OS cannot take pinned
   pages back), so what runs short during training is everything else; here the checkpoint save of
   iteration 10 stages its tensors with the address space capped at what the process holds (a real
   refusal of the C allocator). The run ends with that error; the checkpoint of iteration 5 is complete,
   the tracker names it, the save cut short is incomplete and is not what a new run loads, and that run,
   resumed from iteration 5, repeats iterations 6-10 with the same grad norms and losses, bitwise as
   logged, but for what the control shows too: the same two runs without offloading (as the crash
   drills have), sorted by crash_verdict.judge. Megatron-LM's log has one such difference: the loss it
   logs at the second iteration of every process is the mean of the process's first two iterations
   (``training_log`` in megatron/training/training.py, megatron-core 0.19.2: ``should_reset = not
   is_first_iteration`` keeps the loss sums of a process's first iteration), so the resumed run logs
   iteration 7 as the mean of 6 and 7 where the refused run logged 7 alone. No Megatron setting changes
   it (``--log-interval 1`` logs every iteration; a longer interval only hides the per-iteration values).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.memory_report import last_error_line
from tests.drills import drill_runs
from tests.gpu.host_memory_api import api_main
from tests.gpu.host_memory_megatron import (
    host_short_during_save,
    node_too_small,
    node_too_small_check_off,
    pin_refused_megatron,
    run_in_megatron,
)
from tests.gpu.host_memory_surface import case
from tests.gpu.host_memory_verdicts import API_CASES, add_verdicts, lines, select

ROOT = Path(__file__).resolve().parents[2]
SHORT_RUNS = ["during-save", "resumed", "during-save-control", "resumed-control"]  # host-short-during-save's
API_BOUND_S = 300.0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--megatron":
        name = sys.argv[2]
        sys.argv[1:] = sys.argv[3:]
        run_in_megatron(name)
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--api":
        return api_main(Path(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "host-memory-results")
    parser.add_argument("--only", nargs="*", metavar="DRILL_OR_CASE", help="drills or cases (default: all)")
    args = parser.parse_args()
    try:
        cases = select(args.only)
    except ValueError as error:
        parser.error(str(error))
    drill_runs.exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"cases": {}}
    api_cases = [name for name in cases if name in API_CASES]
    if api_cases:
        report = run_api_cases(args.out, api_cases)
    megatron_cases: dict[str, Callable[[], tuple[list[str], str, dict]]] = {
        "pin-refused-megatron": lambda: pin_refused_megatron(args.out),
        "node-too-small": lambda: node_too_small(args.out),
        "node-too-small-check-off": lambda: node_too_small_check_off(args.out),
        "host-short-during-save": lambda: host_short_during_save(args.out, scratch),
    }
    logs = {"host-short-during-save": ", ".join(f"host-memory-host-short-{run}.log" for run in SHORT_RUNS)}
    scratch = Path(tempfile.mkdtemp(prefix="offload-host-memory-"))
    try:
        # Written before and after every case, so a drill cut short by a time limit keeps what it finished.
        (args.out / "host-memory.json").write_text(json.dumps(add_verdicts(copy.deepcopy(report), cases), indent=1))
        for name in (name for name in cases if name in megatron_cases):
            report["cases"][name] = case(megatron_cases[name]) | {"log": logs.get(name, f"host-memory-{name}.log")}
            (args.out / "host-memory.json").write_text(json.dumps(add_verdicts(copy.deepcopy(report), cases), indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = add_verdicts(report, cases)
    (args.out / "host-memory.json").write_text(json.dumps(report, indent=1))
    for name in cases:
        print(f"{name:30} {report['cases'][name]['verdict']}")
    print("\n".join(lines(report)))
    return 0 if report["passed"] else 1


def run_api_cases(out: Path, cases: list[str]) -> dict[str, Any]:
    """The API cases in one bounded child: its report, or one failing case per case asked for."""
    api_json = out / "host-memory-api.json"
    api_json.unlink(missing_ok=True)
    command = [sys.executable, "-m", "tests.gpu.host_memory_drill", "--api", str(api_json.resolve()), *cases]
    api = drill_runs.run_bounded(command, out / "host-memory-api.log", bound_s=API_BOUND_S, cwd=ROOT)
    if api_json.exists():
        report = json.loads(api_json.read_text())
        api_json.unlink()
    else:
        why = drill_runs.verdict("api", api) if api.stopped else f"exited {api.returncode}: {last_error_line(api.text)}"
        failure = {"passed": False, "failures": [f"the API cases did not finish: {why}"]}
        report = {"cases": {name: dict(failure) for name in cases}}
    for item in report["cases"].values():
        item["log"] = "host-memory-api.log"
    return report


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
