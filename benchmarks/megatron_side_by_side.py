"""Megatron-LM's own training loop (``megatron.training.pretrain``), with and without offloading, side
by side on one machine: the speed and the memory users see.

Clients: our ``scripts/pretrain_gpt.py``, and Megatron-LM's own ``pretrain_gpt.py`` (a checkout of
NVIDIA/Megatron-LM at the branch matching megatron-core, not part of this repository) through our
launcher. Time per iteration is Megatron's own "elapsed time per iteration" at each log interval, the
first interval (warm-up) left out; memory is Megatron's memory report and our log line; losses must
be bitwise the same as without offloading. ``--cap``: then under a GPU memory cap of the no-offload
peak less 90% of the state (``--offload-gpu-memory-cap-gib``): no offload must fail, every policy run.

    python benchmarks/megatron_side_by_side.py --megatron-lm PATH [--config configs/gpt_0p9b.yaml] [--cap]
"""

from __future__ import annotations

import argparse
import json
import os
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

OFFLOAD = ["--offload-optimizer-states"]
POLICIES = ("auto", "finalize", "step")


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
    lines = [f"{'run':34} {'ms/iter':>8} {'x base':>7} {'peak alloc':>10} {'peak resv':>10} {'exposed':>8}  losses"]
    for section in ("runs", "capped"):
        for name, r in results.get(section, {}).items():
            if "error" in r:
                lines.append(f"{name:34} did not run: {r['error'][:100]}")
                continue
            equal = "equal" if r.get("losses_equal", True) else "DIFFER"
            lines.append(
                f"{name:34} {r['step_ms']:8.1f} {r.get('x_base', 1):7.3f} {r.get('peak_allocated_GiB', 0):10.2f} "
                f"{r.get('peak_reserved_GiB', 0):10.2f} {r.get('exposed_ms') or 0:8.1f}  {equal}"
            )
    if "cap_GiB" in results:
        lines.append(f"cap: {results['cap_GiB']:.2f} GiB (no-offload peak allocated less 90% of the state)")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (its pretrain_gpt.py is run)")
    parser.add_argument("--config", default="configs/gpt_0p9b.yaml")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--cap", action="store_true", help="also run under a cap (see above)")
    parser.add_argument("--out", type=Path, default=ROOT / "side-by-side")
    parser.add_argument("extra", nargs="*", help="more Megatron flags for every run (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ours = ["scripts/pretrain_gpt.py", "--config", args.config, *args.extra]
    results: dict[str, Any] = {"config": args.config, "gpus": args.gpus, "runs": {}}
    results["commit"] = os.environ.get("MEGATRON_OFFLOAD_COMMIT", "unknown")
    runs = results["runs"]
    runs["ours: no offload"] = run("ours-no-offload", ours, args.gpus, args.out)
    runs["ours: auto"] = run("ours-auto", ours + OFFLOAD, args.gpus, args.out)
    compare(runs, "ours: no offload")
    if args.megatron_lm:
        theirs = ["-m", "megatron_offload.run", str(args.megatron_lm / "pretrain_gpt.py"), *ours[1:]]
        runs["Megatron-LM: no offload"] = run("megatron-lm-no-offload", theirs, args.gpus, args.out)
        runs["Megatron-LM: auto"] = run("megatron-lm-auto", theirs + OFFLOAD, args.gpus, args.out)
        sub = {name: runs[name] for name in ("Megatron-LM: no offload", "Megatron-LM: auto")}
        compare(sub, "Megatron-LM: no offload")
    base, auto = runs["ours: no offload"], runs["ours: auto"]
    if args.cap and "error" not in base and "error" not in auto:
        cap = base["peak_allocated_GiB"] - 0.9 * auto["offloaded_GiB"]
        results["cap_GiB"] = cap
        capped = ["--offload-gpu-memory-cap-gib", f"{cap:.3f}"]
        results["capped"] = {"capped: no offload": run("capped-no-offload", ours + capped, args.gpus, args.out)}
        for policy in POLICIES:
            argv = ours + capped + OFFLOAD + ["--offload-prefetch", policy]
            results["capped"][f"capped: {policy}"] = run(f"capped-{policy}", argv, args.gpus, args.out)
        compare({"base": base, **results["capped"]}, "base")  # ratios to the uncapped no-offload run
    (args.out / "side_by_side.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "table.txt").write_text(table(results))
    print("\n" + table(results), end="")
    # Every run must have run, except the capped no-offload one, which is meant to fail.
    failed = [n for part in ("runs", "capped") for n, r in results.get(part, {}).items() if "error" in r]
    failed = [name for name in failed if name != "capped: no offload"]
    if failed:
        print(f"megatron_side_by_side: {len(failed)} run(s) failed: {', '.join(failed)}; logs in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
