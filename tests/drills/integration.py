"""Integration runs of Megatron-LM's own training loop, as a table of named flag combinations.

Each entry is a name, a GPU count and its runs; each run is a full training job (scripts/pretrain_gpt.py
or the launcher), with or without --offload-optimizer-states, whose log is parsed for losses and
memory. Checks per entry: losses identical to the entry's first run, 12 bytes per parameter shard
offloaded, for the checkpoint entries an identical continuation after resume, and for the ``capped``
ones that the offload runs fit under a cap of the baseline's peak less 90% of the state (the memory
saving, measured where it matters: the copy out of a step may overlap the next forward where the GPU
has room, so an uncapped peak does not show it).

    python -m tests.drills.integration --gpus 1 --out results/      # every 1-GPU entry
    python -m tests.drills.integration --only dp2 tp2               # by name, in the table's order
    python -m tests.drills.integration --only crash-after-step crash-backward crash-checkpoint --out results/crash

Every run is bounded (``--bound-s``; drill_runs.Bounds for the crash entries): its log goes straight to
a file, and a run past its bound is killed with every process it started (drill_runs.run_bounded); its
entry then fails with a verdict naming the run, where it was and its last log lines.

A crash entry runs beside its control, the same kill without offloading, and ends with one of three
verdicts (crash_verdict.py): ``pass`` (the resumed run bitwise the uninterrupted one), ``megatron-core's
difference`` (every difference shown by the control as well: megatron-core's own resume, not a failure
of ours) or ``FAIL`` (a difference the control does not show, or a run or check that went wrong). Only
``FAIL`` makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.drills import crash_entries, drill_runs
from tests.drills.crash_verdict import FAIL
from tests.drills.integration_checks import cap_from, check, parse_log, render_table

ROOT = Path(__file__).resolve().parents[2]

TINY = ["scripts/pretrain_gpt.py", "--config", "configs/tiny.yaml", "--log-memory-interval", "20"]
OFFLOAD = ["--offload-optimizer-states", "--offload-fraction", "1"]  # all of it moves every step
# The larger shapes run 6 iterations instead of their config's 20, to keep the integration runs short.
SHORT = ["--train-iters", "6", "--log-memory-interval", "6"]
GPT_1B = ["scripts/pretrain_gpt.py", "--config", "configs/gpt_1b.yaml", *SHORT]
GPT_TP2 = ["scripts/pretrain_gpt.py", "--config", "configs/gpt_tp2.yaml", *SHORT]
PLAIN_SCRIPT = "tests/gpu/plain_megatron_script.py"
BOUND_S = 1200.0  # any one run of the other entries (gpt-1b's 6 iterations take a few minutes with start-up)


@dataclass
class Entry:
    name: str
    gpus: int
    runs: dict[str, list[str]]  # run name -> argv after `python` (or `torchrun ... `)
    resume_from: str | None = None  # checkpoint entry: the run that saved
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    capped: bool = False  # offload runs under a cap: the baseline's peak less 90% of the state
    crash: crash_entries.CrashEntry | None = None  # a crash entry (crash_entries.py): its kill and flags


def entries(checkpoint_dir: str) -> list[Entry]:
    save = ["--save", checkpoint_dir, "--save-interval", "10", "--ckpt-format", "torch_dist"]
    return [
        Entry("tiny", 1, {"baseline": TINY, "offload": TINY + OFFLOAD}),
        Entry(
            "tiny-step-prefetch-no-masters",
            1,
            {
                "baseline": TINY,
                "offload": TINY + OFFLOAD + ["--offload-prefetch", "step", "--no-offload-master-weights"],
            },
        ),
        Entry(
            "launcher",
            1,
            {
                # Plain runs of a wheel's Megatron die in its dataset-helper compile step (see
                # megatron_training.py), so the baseline too goes through the launcher, without our flag.
                "launcher-plain": ["-m", "megatron_offload.run", PLAIN_SCRIPT, *TINY[1:]],
                "launcher-offload": ["-m", "megatron_offload.run", PLAIN_SCRIPT, *TINY[1:], *OFFLOAD],
            },
        ),
        Entry(
            "checkpoint",
            1,
            {"uninterrupted-save": TINY + OFFLOAD + save, "resumed": TINY + OFFLOAD + ["--load", checkpoint_dir]},
            resume_from="uninterrupted-save",
        ),
        # Megatron-LM's own resume with torch AdamW (no TransformerEngine/apex), without offloading: shows
        # whether a failure of the entry above is megatron-core's or ours.
        Entry(
            "checkpoint-no-offload",
            1,
            {"uninterrupted-save": TINY + save, "resumed": TINY + ["--load", checkpoint_dir]},
            resume_from="uninterrupted-save",
        ),
        Entry("dp2", 2, {"baseline": TINY, "offload": TINY + OFFLOAD}),
        Entry(
            "launcher-dp2",
            2,
            {
                "launcher-plain": ["-m", "megatron_offload.run", PLAIN_SCRIPT, *TINY[1:]],
                "launcher-offload": ["-m", "megatron_offload.run", PLAIN_SCRIPT, *TINY[1:], *OFFLOAD],
            },
        ),
        Entry("gpt-1b", 1, {"baseline": GPT_1B, "offload": GPT_1B + OFFLOAD}, capped=True),
        Entry(
            "gpt-tp2",
            2,
            {"baseline": GPT_TP2, "offload": GPT_TP2 + OFFLOAD},
            env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
            capped=True,
        ),
        Entry(
            "tp2",
            2,
            {
                "baseline": TINY + ["--tensor-model-parallel-size", "2"],
                "offload": TINY + ["--tensor-model-parallel-size", "2"] + OFFLOAD,
            },
            env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},  # megatron-core asserts it for TP > 1 on Hopper
        ),
        # Killed with SIGKILL, then resumed in a new process, beside a control without offloading: see
        # crash_entries.py (an entry for another offload flag is one line of its ENTRIES).
        *(Entry(crash.name, 1, {}, crash=crash) for crash in crash_entries.ENTRIES),
    ]


def run(entry: Entry, run_name: str, argv: list[str], out: Path, bound_s: float) -> dict:
    """One run under torchrun, bounded: what the checks read from its log, and how it ended."""
    command = drill_runs.torchrun(entry.gpus) + argv
    log = out / f"{entry.name}-{run_name}.log"
    print(f"[{entry.name}/{run_name}] {' '.join(command)}", flush=True)
    outcome = drill_runs.run_bounded(command, log, bound_s=bound_s, env={**os.environ, **entry.env}, cwd=ROOT)
    parsed = parse_log(outcome.text)
    parsed |= {"returncode": outcome.returncode, "seconds": round(outcome.seconds, 1), "stopped": outcome.stopped}
    parsed |= {"verdict": drill_runs.verdict(run_name, outcome) if outcome.stopped else None}
    parsed |= {"left_behind": outcome.left_behind}
    if outcome.returncode != 0:
        print(outcome.text[-3000:], flush=True)
    return parsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, help="run only entries for this many GPUs")
    parser.add_argument("--only", nargs="*", help="entry names")
    parser.add_argument("--out", type=Path, default=ROOT / "integration-results")
    parser.add_argument(
        "--bound-s",
        type=float,
        help=f"seconds any one run may take before it is killed (default {BOUND_S:g}; "
        f"crash entries {drill_runs.Bounds().run_s:g})",
    )
    args = parser.parse_args()
    drill_runs.exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = tempfile.mkdtemp(prefix="offload-ckpt-")
    bounds = drill_runs.Bounds(**({"run_s": args.bound_s} if args.bound_s else {}))
    crash_drill = crash_entries.CrashDrill(args.out, drill_runs.torchrun(1), bounds, cwd=ROOT, parse=parse_log)
    summary = {}
    try:
        for entry in entries(checkpoint_dir):
            if (args.gpus and entry.gpus != args.gpus) or (args.only and entry.name not in args.only):
                continue
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
            if entry.crash:
                results, verdict, facts = crash_drill.run_entry(entry.crash, entry.env)
                summary[entry.name] = {
                    "gpus": entry.gpus,
                    "verdict": verdict.line(),
                    "status": verdict.status,
                    "failures": verdict.failures,
                    "megatron_core_differences": verdict.megatron_core,
                    "control_only_differences": verdict.control_only,
                    "runs": results,
                    "crash": facts,
                }
            else:
                results = {}
                for name, argv in entry.runs.items():
                    capped = entry.capped and "offload" in name and "baseline" in results
                    cap = cap_from(results["baseline"]) if capped else None
                    if cap is not None:
                        argv = [*argv, "--offload-gpu-memory-cap-gib", f"{cap:.3f}"]
                    results[name] = run(entry, name, argv, args.out, args.bound_s or BOUND_S) | {"cap_GiB": cap}
                summary[entry.name] = {"gpus": entry.gpus, "failures": check(entry, results), "runs": results}
            # Written after every entry, so a run cut short by a time limit keeps what it finished.
            (args.out / "integration.json").write_text(json.dumps(summary, indent=1, default=str))
            (args.out / "table.txt").write_text(render_table(summary))
            item = summary[entry.name]
            print(f"=== {entry.name}: {item.get('verdict') or ('ok' if not item['failures'] else FAIL)}", flush=True)
    finally:
        crash_drill.close()
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    print("\n" + render_table(summary), end="")
    return 0 if all(not item["failures"] for item in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
