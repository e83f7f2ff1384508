"""Megatron-LM's own training loop (``megatron.training.pretrain``), with and without offloading, side
by side on one machine: the speed and the memory users see.

Clients: our ``scripts/pretrain_gpt.py``, and Megatron-LM's own ``pretrain_gpt.py`` (a checkout of
NVIDIA/Megatron-LM at the branch matching megatron-core, not part of this repository) through our
launcher. Time per iteration is Megatron's own "elapsed time per iteration" at each log interval, the
first interval (warm-up) left out; memory is Megatron's memory report and our log line; losses must
be bitwise the same as without offloading. Then under a GPU memory cap of the no-offload
peak less 90% of the state (``--offload-gpu-memory-cap-gib``): no offload must fail, every policy run;
under a cap of the no-offload peak less 50% of the state, ``--offload-fraction auto``. Each at every
``--log-intervals`` (Megatron synchronises the device at each logged iteration).

    python benchmarks/megatron_side_by_side.py --megatron-lm PATH [--log-intervals 1 5] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from memory_report import GIB, MIB, last_error_line, parse_log  # noqa: E402

from megatron_offload.launch_config import needs_one_connection  # noqa: E402
from megatron_offload.units import cap_below_peak  # noqa: E402

OFFLOAD = ["--offload-optimizer-states"]


def run(name: str, argv: list[str], gpus: int, out: Path) -> dict[str, Any]:
    """One training job under torchrun; its figures from the log."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    if needs_one_connection(argv):
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core requires it with TP or CP > 1
    print(f"[{name}] {' '.join(argv)}", flush=True)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    text = result.stdout + result.stderr
    (out / f"{name}.log").write_text("$ " + " ".join(command) + "\n" + text)
    log = parse_log(text)
    figures: dict[str, Any] = {"argv": argv, "returncode": result.returncode}
    if result.returncode != 0 or not log.steps:
        return figures | {"error": last_error_line(text)}
    iterations = sorted(log.steps)
    steady = iterations[1:] or iterations  # the first interval holds the first, slow iterations
    last = log.steps[iterations[-1]]
    figures |= {
        "losses": {i: log.steps[i].loss for i in iterations},
        "step_ms": statistics.median(log.steps[i].step_ms for i in steady),
        "step_ms_per_interval": [log.steps[i].step_ms for i in iterations],
        "offloaded_GiB": last.offloaded_gib,
        "exposed_ms": last.exposed_ms,
        "copy_out_in_ms": [last.copy_out_ms, last.copy_in_ms],
    }
    rank = log.memory_rank
    if rank is not None:
        memory = log.memory[rank][max(log.memory[rank])]
        figures["peak_allocated_GiB"] = memory.max_allocated * MIB / GIB
        figures["peak_reserved_GiB"] = memory.max_reserved * MIB / GIB
    print(f"[{name}] {json.dumps({k: v for k, v in figures.items() if k not in ('argv', 'losses')})}", flush=True)
    return figures


def compare(runs: dict[str, Any], base: str) -> None:
    """Ratios to ``base`` and bitwise loss equality, written into each run."""
    reference = runs[base]
    for figures in runs.values():
        if "error" in figures or "error" in reference:
            continue
        figures["x_base"] = figures["step_ms"] / reference["step_ms"]
        figures["losses_equal"] = figures["losses"] == reference["losses"]


def table(results: dict[str, Any]) -> str:
    """Per log interval: ms/iter, the ratio to uncapped no offload, peaks, exposed copy time, losses."""
    head = f"{'run':26} {'ms/iter':>8} {'x base':>7} {'peak alloc':>10} {'peak resv':>10} {'cap':>6} {'exposed':>8}"
    lines = [f"{results.get('client', '')}, {results.get('config', '')}, commit {results.get('commit', '')}"]
    for section, runs in results["runs"].items():
        lines += ["", section, head + "  losses"]
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"{name:26} did not run: {r['error'][:100]}")
                continue
            equal = "equal" if r.get("losses_equal", True) else "DIFFER"
            lines.append(
                f"{name:26} {r['step_ms']:8.1f} {r.get('x_base', 1):7.3f} {r.get('peak_allocated_GiB', 0):10.2f} "
                f"{r.get('peak_reserved_GiB', 0):10.2f} {r.get('cap_GiB', 0):6.2f} {r.get('exposed_ms') or 0:8.1f}"
                f"  {equal}"
            )
    return "\n".join(lines) + "\n"


# The acceptance matrix of issue 13, per log interval: (name, offload flags, cap as a share of the state
# taken off the no-offload peak; None: uncapped). The capped no-offload runs are meant to fail.
MATRIX = (
    ("no offload", None, None),
    ("full offload (auto)", [], None),
    ("fraction auto", ["--offload-fraction", "auto"], None),
    ("cap 90%: no offload", None, 0.9),
    ("cap 90%: auto", ["--offload-prefetch", "auto"], 0.9),
    ("cap 90%: finalize", ["--offload-prefetch", "finalize"], 0.9),
    ("cap 90%: step", ["--offload-prefetch", "step"], 0.9),
    ("cap 50%: no offload", None, 0.5),
    ("cap 50%: fraction auto", ["--offload-fraction", "auto"], 0.5),
)
MEANT_TO_FAIL = ("cap 90%: no offload", "cap 50%: no offload")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout: its pretrain_gpt.py is run")
    parser.add_argument("--config", default="configs/gpt_0p9b.yaml")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--log-intervals", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--only", nargs="*", help="names from the matrix (default: all; 'no offload' always runs)")
    parser.add_argument("--train-iters", type=int, default=15)
    parser.add_argument(
        "--caps-from",
        nargs=2,
        type=float,
        metavar=("PEAK_GIB", "STATE_GIB"),
        help="the uncapped no-offload peak allocated and the state (GiB) measured by an earlier call: caps are "
        "set from these, so the capped runs can go to a device call of their own",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "side-by-side")
    parser.add_argument("extra", nargs="*", help="more Megatron flags for every run (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.megatron_lm:  # Megatron-LM's own script, through our launcher
        client = ["-m", "megatron_offload.run", str(args.megatron_lm / "pretrain_gpt.py")]
    else:
        client = ["scripts/pretrain_gpt.py"]
    common = [*client, "--config", args.config, "--train-iters", str(args.train_iters), *args.extra]
    results: dict[str, Any] = {"config": args.config, "gpus": args.gpus, "client": client[-1], "runs": {}}
    results["commit"] = os.environ.get("MEGATRON_OFFLOAD_COMMIT", "unknown")
    for interval in args.log_intervals:
        argv = [*common, "--log-interval", str(interval)]
        runs: dict[str, Any] = {}
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
            slug = f"log{interval}-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
            runs[name] = run(slug, full, args.gpus, args.out) | ({"cap_GiB": cap} if cap_share is not None else {})
        if "no offload" in runs:
            compare(runs, "no offload")
        results["runs"][f"log-interval {interval}"] = runs
        (args.out / "side_by_side.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "table.txt").write_text(table(results))
    print("\n" + table(results), end="")
    failed = [
        f"{section}: {name}"
        for section, runs in results["runs"].items()
        for name, figures in runs.items()
        if ("error" in figures) != (name in MEANT_TO_FAIL) or figures.get("losses_equal") is False
    ]
    if failed:
        print(f"megatron_side_by_side: {len(failed)} run(s) did not do what they must: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
