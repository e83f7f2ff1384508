"""Megatron-LM's own training loop (``megatron.training.pretrain``), with and without offloading, side
by side on one machine: the speed and the memory users see.

Clients: our ``scripts/pretrain_gpt.py``, and Megatron-LM's own ``pretrain_gpt.py`` (a checkout of
NVIDIA/Megatron-LM at the branch matching megatron-core, not part of this repository) through our launcher. Time
per iteration is the median of Megatron's own "elapsed time per iteration" from iteration 3 on (at a log interval
k > 1, the lines from 2k on: the first hold the slow first iterations); a run has 15 iterations at interval 1 and
8k at k > 1 unless ``--train-iters`` says (``matrix_iterations``); memory is Megatron's memory report and our log
line; losses must be bitwise the same as without offloading. Then under a GPU memory cap of the no-offload peak
less 90% of the state (``--offload-gpu-memory-cap-gib``): no offload must fail, every policy run; under a cap of
the no-offload peak less 50% of the state, ``--offload-fraction auto``. Each at every ``--log-intervals``
(Megatron synchronises the device at each logged iteration).

``--upstream-megatron-lm PATH`` (a copy of Megatron-LM's ``dev`` branch: its ``megatron`` package,
``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``) adds upstream's own offloader beside
ours: two rows run by upstream's own ``pretrain_gpt.py`` and loop, not through our launcher, with PATH
first on ``PYTHONPATH`` so that its megatron.core shadows the installed one; same model and flags, no
offload and ``--chunked-optimizer-state-offload``. Their ratios and losses are to upstream's own
no-offload row.

``--rounds N`` runs every row of the matrix that ran N times, in turn, every second round in reverse order (the
machine's pace drifts over a call): each row's ms/iter is the median of its counted iterations from all rounds,
each round's own beside it. The host's pace is sampled beside every run of the matrix and the sweep
(host_pace.py, ``host-pace.txt`` under ``--out``) and printed beside each row: two rows that ran at different
paces do not compare.

``--profile [NAME ...]`` adds a separate, profiled run of each named row (default: no offload, full
offload, prefetch step and, with upstream, its two rows) at the first log interval, under Megatron's
``--profile --use-pytorch-profiler``, and compares each offload trace with its no-offload trace
(``trace_summary.py``: compute-stream busy time and its share where copies run). Profiled iterations
run slower: their times are never the ms/iter of the table. ``--profile-only`` runs just those.

``--phases`` runs our rows through ``benchmarks/phases.py`` instead: CUDA events at each micro-batch's
forward and backward and at the step, no profiler, so the iterations are the timed ones; each row's JSON
gets its medians per phase (``phases_ms``), and the sweep's text each cap's difference to no offload.

``--sweep`` (memory_speed_curve.py) runs the memory-speed curve instead of the matrix: caps at the
no-offload peak reserved less ``--caps`` percents of the state, at the first of ``--log-intervals``: 24
iterations a run and ms/iter the median of iterations 3-24 at 1, 40 and the lines from iteration 10 at 5;
``--global-batch 8`` (4 micro-batches of 2) or 32 (16). Runs: one uncapped no offload, one uncapped upstream,
ours (the default) once per cap, with ``--step-row`` ours with ``--offload-prefetch step`` once uncapped (no
offload, upstream and step under a cap follow from their uncapped runs). Estimate on one H100, start-up ~25 s
(no offload), ~45-50 s (offloading) a run: global batch 8, caps 90 75 50 25 without upstream: 5 runs, ~6 min;
all five caps with upstream: 7 runs, ~8 min; global batch 32, caps 90 50: 4 runs, ~5.5 min (at interval 5, 40
iterations a run: more). Each run's JSON and plot are written as it ends, so a call cut off still leaves the
caps done. When nothing can run (no CUDA GPU, no Megatron-LM script at ``--megatron-lm``, no megatron.training)
it stops at once, one line.

    python -m benchmarks.megatron_side_by_side --megatron-lm PATH [--upstream-megatron-lm PATH]
        [--log-intervals 1 5] [--only NAME ...] [--rounds N] [--profile [NAME ...]] [--profile-only]
    python -m benchmarks.megatron_side_by_side --megatron-lm PATH --sweep --global-batch 8 --caps 90 50 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from benchmarks import megatron_job as job
from benchmarks import memory_speed_curve as curve
from benchmarks import memory_speed_sweep
from benchmarks.host_pace import PaceLog
from benchmarks.side_by_side_args import parse_args
from benchmarks.side_by_side_profile import run_profiled
from benchmarks.side_by_side_rounds import in_turn, pool, round_name
from benchmarks.side_by_side_rows import (
    MATRIX,
    MEANT_TO_FAIL,
    OFFLOAD,
    UPSTREAM,
    UPSTREAM_BASE,
    UPSTREAM_OFFLOAD,
    compare,
    selected_upstream_rows,
    slug,
)
from benchmarks.side_by_side_table import table
from benchmarks.side_by_side_upstream import prepare_upstream, upstream_env
from megatron_offload.config.files import expand_config_argv, preflight
from megatron_offload.core.units import cap_below_peak

MATRIX_ITERS = 15  # iterations a run of the matrix at --log-interval 1 (matrix_iterations)


def run_matrix(args: argparse.Namespace, results: dict[str, Any], clients: dict[str, list[str]], env: dict) -> None:
    """The matrix at every log interval, our rows then upstream's, each compared with its own base; with
    ``--rounds N``, every row that ran in the first round runs N - 1 times more, in turn (``in_turn``), and each
    row's rounds are pooled (side_by_side_rounds.py). A row that failed in the first round is not run again.
    Each run gets the host's pace over its counted iterations (host_pace.py)."""
    with PaceLog(args.out / "host-pace.txt") as pace:
        run = pace.timed(job.run)
        for interval in args.log_intervals:
            results["runs"][f"log-interval {interval}"] = run_interval(args, results, clients, env, interval, run)
            (args.out / "side_by_side.json").write_text(json.dumps(results, indent=1, default=str))


def run_interval(
    args: argparse.Namespace,
    results: dict[str, Any],
    clients: dict[str, list[str]],
    env: dict,
    interval: int,
    run: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """The matrix at one log interval (``run_matrix``), through ``run`` (the job runner)."""
    upstream_rows = selected_upstream_rows(set(args.only or ()), "upstream" in clients)
    tail = ["--train-iters", str(matrix_iterations(args, interval)), *args.extra, "--log-interval", str(interval)]
    argv = [*clients["ours"], *tail]
    runs: dict[str, Any] = {}
    ran: dict[str, tuple[list[str], dict | None, dict]] = {}  # row: (argv, env, figures added to its runs)
    for name, flags, cap_share in MATRIX:
        if args.only and name not in args.only and not (name == "no offload" and not args.caps_from):
            continue
        full = argv + ([] if flags is None else OFFLOAD + flags)
        if cap_share is not None:
            base, offload = runs.get("no offload", {}), runs.get("full offload (auto)", {})
            state = offload.get("offloaded_GiB") or results.get("state_GiB")
            if args.caps_from:
                base, state = {"peak_allocated_GiB": args.caps_from[0]}, args.caps_from[1]
            if "error" in base or not state or "peak_allocated_GiB" not in base:
                runs[name] = {"error": "no uncapped no-offload peak or state size to cap from"}
                continue
            results["state_GiB"] = state
            cap = cap_below_peak(base["peak_allocated_GiB"], state, cap_share)
            results[f"cap {cap_share:.0%} GiB"] = cap
            full += ["--offload-gpu-memory-cap-gib", f"{cap:.3f}"]
        added = {"cap_GiB": cap} if cap_share is not None else {}
        ran[name] = (full, None, added)
        runs[name] = run(round_name(interval, slug(name), 1), full, args.gpus, args.out) | added
    for name, flags in upstream_rows:
        ran[name] = ([*clients["upstream"], *tail, *flags], env, {})
        runs[name] = run(round_name(interval, slug(name), 1), ran[name][0], args.gpus, args.out, env)
    rounds = {name: [figures] for name, figures in runs.items() if name in ran and "error" not in figures}
    for round_ in range(2, args.rounds + 1):  # the same runs again, every second round in reverse
        for name in in_turn(list(rounds), round_):
            run_argv, run_env, added = ran[name]
            again = run(round_name(interval, slug(name), round_), run_argv, args.gpus, args.out, run_env)
            rounds[name].append(again | added)
    runs |= {name: pool(figures) for name, figures in rounds.items()}
    if "no offload" in runs:
        compare(runs, "no offload", [name for name, _, _ in MATRIX])
    if UPSTREAM_BASE in runs:
        compare(runs, UPSTREAM_BASE, [name for name, _ in UPSTREAM])
    return runs


def matrix_iterations(args: argparse.Namespace, interval: int) -> int:
    """Iterations per run of the matrix: ``--train-iters``, else 15 at interval 1 (13 counted) and the sweep's 8k
    at k > 1. Each line at k averages k iterations and Python's full garbage collection (about half a second,
    once in a few dozen iterations, with or without offloading) lands in one of them: counting two lines, one
    such pause moves a row by a tenth; the median of seven sets it aside."""
    if args.train_iters:
        return args.train_iters
    return MATRIX_ITERS if interval <= 1 else curve.iterations_for(interval)[0]


def failures(results: dict[str, Any]) -> list[str]:
    """The runs that did not do what they must: failed (or ran where meant to fail), losses not bitwise
    equal to their base's, a profiled run without its trace. The trace verdict is a finding, not one."""
    failed = [
        f"{section}: {name}"
        for section, runs in results["runs"].items()
        for name, figures in runs.items()
        if ("error" in figures) != (name in MEANT_TO_FAIL) or figures.get("losses_equal") is False
    ]
    profiled = results.get("profiled", {}).get("runs", {})
    return failed + [f"profiled: {name}" for name, figures in profiled.items() if "error" in figures]


def nothing_can_run(args: argparse.Namespace) -> str | None:
    """Why no run can start, in one line (no Megatron-LM script at the given path, a bad config file, no
    megatron.training, no CUDA GPU); None when runs can start."""
    if args.megatron_lm and not (args.megatron_lm / "pretrain_gpt.py").is_file():
        return f"--megatron-lm {args.megatron_lm}: no pretrain_gpt.py there (a checkout of NVIDIA/Megatron-LM)"
    return preflight(["--config", args.config])


def sweep(args: argparse.Namespace, results: dict[str, Any], clients: dict[str, list[str]], env: dict) -> int:
    """The memory-speed curve (memory_speed_curve.py): curve.json and curve.png under --out; status 1 when
    one of our offload rows did not run or its losses differ from no offload's."""
    upstream = "upstream" in clients
    estimate = curve.estimate_s(len(args.caps), (args.global_batch or 8) // 2, upstream, args.rounds, args.step_row)
    runs = args.rounds * (1 + len(curve.OURS) * len(args.caps)) + upstream + args.step_row
    rounds = f", {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"sweep: caps {args.caps}{rounds}, about {estimate / 60:.1f} min ({runs} runs)", flush=True)
    flags = {"ours": OFFLOAD, "upstream": UPSTREAM_OFFLOAD}
    head = {key: results[key] for key in ("config", "client", "commit", "gpus", "upstream") if key in results}
    with PaceLog(args.out / "host-pace.txt") as pace:  # the host's pace beside every run (host_pace.py)
        result = memory_speed_sweep.run_sweep(args, clients, env, pace.timed(job.run), flags, head)
    if "error" in result:
        (args.out / "curve.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"megatron_side_by_side: sweep stopped: {result['error']}")
        return 1
    (args.out / "curve.txt").write_text(curve.table(result))
    print(curve.table(result), end="")
    bad = memory_speed_sweep.failed_rows(result)
    if bad:
        print(f"megatron_side_by_side: {len(bad)} of our runs did not run or differ in losses: {', '.join(bad)}")
    return 1 if bad else 0


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    problem = nothing_can_run(args)
    if problem:
        print(f"megatron_side_by_side: nothing can run: {problem}")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.megatron_lm:  # Megatron-LM's own script, through our launcher (with --phases, marked: phases.py)
        launcher = "benchmarks.phases" if args.phases else "megatron_offload.run"
        client = ["-m", launcher, str(args.megatron_lm / "pretrain_gpt.py")]
    else:
        client = ["scripts/pretrain_gpt.py"]
    if args.global_batch and not args.sweep:
        args.extra = ["--global-batch-size", str(args.global_batch), *args.extra]
    clients = {"ours": [*client, "--config", args.config]}
    results: dict[str, Any] = {"config": args.config, "gpus": args.gpus, "client": client[-1], "runs": {}}
    results["commit"] = os.environ.get("MEGATRON_OFFLOAD_COMMIT", "unknown")
    env: dict[str, str] = {}
    if args.upstream_megatron_lm:  # upstream's own script, loop and megatron.core; the config file as flags
        upstream = args.upstream_megatron_lm
        note = prepare_upstream(upstream)
        env = upstream_env(upstream, args.out)
        results["upstream"] = {"path": str(upstream), "note": note, "env": env}
        clients["upstream"] = [str(upstream / "pretrain_gpt.py"), *expand_config_argv(["--config", args.config])]
        print(f"upstream: {results['upstream']['note']}; env {env}", flush=True)
    if args.sweep:
        return sweep(args, results, clients, env)
    if not args.profile_only:
        run_matrix(args, results, clients, env)
    if args.profile is not None:
        run_profiled(args, results, clients, env)
    (args.out / "side_by_side.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "table.txt").write_text(table(results))
    print("\n" + table(results), end="")
    failed = failures(results)
    if failed:
        print(f"megatron_side_by_side: {len(failed)} run(s) did not do what they must: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
