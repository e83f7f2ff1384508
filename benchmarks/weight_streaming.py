"""Weight streaming in Megatron-LM's own loop, side by side with no offload on one GPU: speed, bytes over
the link, memory, losses.

Rows (Megatron-LM's ``pretrain_gpt.py`` through our launcher, full recompute one layer at a time in
every row, so that the only difference is streaming): ``no offload`` and ``weights`` (with
``--offload-optimizer-states --offload-weights``), at each ``--log-intervals``; ``--fit CAP`` adds, under
``--offload-gpu-memory-cap-gib CAP``, no offload, optimizer-state offload alone and weights. Figures per
row: ms per iteration (median after the first interval), Megatron's ``forward-backward`` timer per
iteration (``--timing-log-level 1``: forward and backward of every micro-batch), the weights' bytes each
way and their exposed copy time per iteration (our log line), peak reserved GPU memory, and whether the
losses equal no offload's bitwise. ``--profile`` adds one profiled run of each of the two rows
(iterations 5-6 under torch.profiler) whose traces ``trace_summary.py`` compares. ``--link`` measures the
host link first and gives each weight-streaming row its optimizer step beside that step's floor
(``link_speed.py``).

    python -m benchmarks.weight_streaming --megatron-lm PATH --config configs/gpt_1b.yaml \\
        --extra "--micro-batch-size 8 --global-batch-size 64" [--log-intervals 1 5] [--fit 20] [--profile]
        [--footprint] [--link]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.link_speed import measured, with_step_floors
from benchmarks.megatron_job import run

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
WEIGHTS = ["--offload-optimizer-states", "--offload-weights"]
_TIMER = re.compile(r"forward-backward[ .]*:\s*\(([\d.]+),\s*([\d.]+)\)")
_WEIGHTS = re.compile(r"weights in/out per iter \(GiB\): ([\d.]+)/([\d.]+) \| weights exposed \(ms\): ([\d.]+)")


def log_figures(text: str) -> dict[str, Any]:
    """From a log: the forward-backward timer per iteration (Megatron divides it by the log interval)
    after the first interval, and the weights' figures of the last line."""
    timers = [float(high) for _, high in _TIMER.findall(text)]
    figures: dict[str, Any] = {}
    if len(timers) > 1:
        figures["forward_backward_ms"] = statistics.median(timers[1:])
    weights = _WEIGHTS.findall(text)
    if weights:
        inward, outward, exposed = (float(x) for x in weights[-1])
        figures |= {"weights_in_GiB": inward, "weights_out_GiB": outward, "weights_exposed_ms": exposed}
    return figures


def row(name: str, argv: list[str], out: Path) -> dict[str, Any]:
    figures = run(name, argv, 1, out)
    log = out / f"{name}.log"
    if log.exists():
        figures |= log_figures(log.read_text())
    return figures


def client(args: argparse.Namespace, who: str) -> list[str] | None:
    """Our launcher on Megatron-LM's ``pretrain_gpt.py`` with the config, full recompute and ``--extra``;
    None (said on stderr) where ``--megatron-lm`` has no such script. Makes ``--out``."""
    script = args.megatron_lm / "pretrain_gpt.py"
    if not script.is_file():
        print(f"{who}: no pretrain_gpt.py in {args.megatron_lm}", file=sys.stderr)
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    return ["-m", "megatron_offload.run", str(script), "--config", args.config, *RECOMPUTE, *shlex.split(args.extra)]


def ratios(results: dict[str, Any], base: str) -> None:
    """Each row's time and forward-backward as a ratio to ``base`` in the same invocation; losses."""
    reference = results.get(base, {})
    for figures in results.values():
        for key in ("step_ms", "forward_backward_ms"):
            if key in figures and key in reference:
                figures[f"{key}_ratio"] = round(figures[key] / reference[key], 4)
        if "losses" in figures and "losses" in reference:
            figures["losses_equal"] = figures["losses"] == reference["losses"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True, help="folder with Megatron-LM's pretrain_gpt.py")
    parser.add_argument("--config", default="configs/gpt_1b.yaml")
    parser.add_argument("--extra", default="", help="more Megatron flags for every row, as one string")
    parser.add_argument("--train-iters", type=int, default=10)
    parser.add_argument("--log-intervals", type=int, nargs="*", default=[1, 5])
    parser.add_argument("--fit", type=float, default=None, metavar="GIB", help="also run the rows under this cap")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--footprint",
        action="store_true",
        help="also run state offload alone and weights, uncapped, with --offload-prefetch step (the smallest "
        "footprint): their peak reserved memory is the smallest cap each fits",
    )
    parser.add_argument(
        "--link", action="store_true",
        help="measure the host link first (in a process of its own) and give each weight-streaming row its "
        "optimizer step beside that step's floor over it",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("weight-streaming"))
    args = parser.parse_args()
    base = client(args, "weight_streaming")
    if base is None:
        return 2
    link = measured() if args.link else None  # before the rows: the GPU is free
    results: dict[str, Any] = {}
    for interval in args.log_intervals:  # --log-intervals with no value: none of these rows
        tail = ["--train-iters", str(args.train_iters), "--log-interval", str(interval), "--timing-log-level", "1"]
        for name, flags in (("no offload", []), ("weights", WEIGHTS)):
            key = f"{name}, log interval {interval}"
            results[key] = row(key.replace(" ", "-").replace(",", ""), [*base, *flags, *tail], args.out)
        ratios(
            {k: v for k, v in results.items() if k.endswith(f"interval {interval}")},
            f"no offload, log interval {interval}",
        )
    if args.fit is not None:
        tail = [
            "--train-iters",
            str(args.train_iters),
            "--log-interval",
            "1",
            "--offload-gpu-memory-cap-gib",
            str(args.fit),
        ]
        for name, flags in (("no offload", []), ("state offload", WEIGHTS[:1]), ("weights", WEIGHTS)):
            key = f"{name}, cap {args.fit:g} GiB"
            results[key] = row(key.replace(" ", "-").replace(",", ""), [*base, *flags, *tail], args.out)
    if args.footprint:
        tail = ["--train-iters", str(args.train_iters), "--log-interval", "1", "--offload-prefetch", "step"]
        for name, flags in (("state offload", WEIGHTS[:1]), ("weights", WEIGHTS)):
            key = f"{name}, smallest footprint"
            results[key] = row(key.replace(" ", "-").replace(",", ""), [*base, *flags, *tail], args.out)
    if args.profile:
        tail = ["--train-iters", "7", "--log-interval", "1", "--profile", "--use-pytorch-profiler"]
        tail += ["--profile-step-start", "5", "--profile-step-end", "6"]
        for name, flags in (("no offload", []), ("weights", WEIGHTS)):
            folder = args.out / f"profile-{name.replace(' ', '-')}"
            key = f"{name}, profiled"
            results[key] = row(
                key.replace(" ", "-").replace(",", ""),
                [*base, *flags, *tail, "--tensorboard-dir", str(folder / "tb")],
                args.out,
            )
    if link is not None:
        with_step_floors(results, link)
    (args.out / "weight-streaming.json").write_text(json.dumps(results, indent=1, default=str))
    for key, figures in results.items():
        shown = {k: figures[k] for k in figures if k.endswith(("_ms", "_ratio", "_GiB", "_floor", "equal", "error"))}
        print(f"{key}: {json.dumps(shown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
