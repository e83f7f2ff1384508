"""megatron_side_by_side.py's command line: the matrix's options, the profiled runs', the memory-speed
curve's (``--sweep``) and the Megatron flags for every run after ``--``; checked for the combinations that
cannot run."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import memory_speed_curve as curve
from benchmarks.megatron_job import ROOT
from benchmarks.side_by_side_rows import PROFILED


def parse_args(description: str) -> argparse.Namespace:
    """The command line's options; ``description`` heads the help."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout: its pretrain_gpt.py is run")
    parser.add_argument(
        "--upstream-megatron-lm",
        type=Path,
        help="a copy of Megatron-LM's dev branch (megatron/, pretrain_gpt.py, gpt_builders.py, model_provider.py): "
        "upstream's own offloader as two more rows, run by its own script and loop",
    )
    parser.add_argument("--config", default="configs/gpt_0p9b.yaml")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--log-intervals", type=int, nargs="+", default=[1, 5])
    parser.add_argument(
        "--only",
        nargs="*",
        help="names from the matrix or upstream's rows (default: all; 'no offload' always runs, and "
        "'upstream no offload' with any upstream row)",
    )
    parser.add_argument(
        "--train-iters",
        type=int,
        help="iterations per run (default: 15 at --log-interval 1, 8k at k > 1, whose lines from 2k on count: "
        "seven lines, so that one holding a garbage-collection pause of about half a second does not decide the row)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="run each row N times, in turn, and pool each row's iterations (the machine's pace drifts over a "
        "call): every row of the matrix that ran; with --sweep, no offload and ours under each cap (default 1)",
    )
    parser.add_argument(
        "--caps-from",
        nargs=2,
        type=float,
        metavar=("PEAK_GIB", "STATE_GIB"),
        help="the uncapped no-offload peak allocated and the state (GiB) measured by an earlier call: caps are "
        "set from these, so the capped runs can go to a job of their own",
    )
    parser.add_argument(
        "--profile",
        nargs="*",
        metavar="NAME",
        help=f"also a separate profiled run of these rows (default: {', '.join(PROFILED)} and upstream's two), "
        "at the first log interval; each offload trace compared with its base's",
    )
    parser.add_argument("--profile-only", action="store_true", help="only the profiled runs (with --profile)")
    parser.add_argument("--window-ms", type=float, default=25.0, help="the trace comparison's window")
    parser.add_argument("--global-batch", type=int, help="--global-batch-size of every run (default: the config's)")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="our rows through benchmarks.phases: each iteration's phases (forwards, backwards, step) in GPU and "
        "host ms from CUDA events, their medians in the JSON and the curve's text (needs --megatron-lm)",
    )
    curves = parser.add_argument_group("the memory-speed curve (--sweep; memory_speed_curve.py)")
    curves.add_argument("--sweep", action="store_true", help="the cap sweep, not the matrix: curve.json, curve.png")
    curves.add_argument(
        "--caps",
        type=int,
        nargs="+",
        default=list(curve.DEFAULT_CAPS),
        metavar="PERCENT",
        help="caps: the no-offload peak reserved less these percents of the state (run in this order)",
    )
    curves.add_argument(
        "--link-gbps",
        type=float,
        default=curve.DEFAULT_LINK_GBPS,
        help="the host link for the floor when no run logs one (GB/s)",
    )
    curves.add_argument(
        "--first-forward-ms",
        type=float,
        help="the first micro-batch's forward for the floor "
        "(default: a third of a micro-batch's share of the no-offload iteration)",
    )
    curves.add_argument("--state-gib", type=float, help="the state per rank (default: 12 bytes a parameter)")
    curves.add_argument("--run-every-cell", action="store_true",
                       help="run no offload under every cap, also where its uncapped run tells")  # fmt: skip
    curves.add_argument(
        "--step-row",
        action="store_true",
        help="also ours with --offload-prefetch step, once, uncapped (under each cap it fits)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "side-by-side")
    parser.add_argument("extra", nargs="*", help="more Megatron flags for every run (after --)")
    args = parser.parse_args()
    if args.profile_only and args.profile is None:
        parser.error("--profile-only needs --profile")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more (each round runs every row once more)")
    if args.phases and not args.megatron_lm:
        parser.error("--phases marks Megatron-LM's own loop: give --megatron-lm PATH")
    return args
