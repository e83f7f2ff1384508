"""Print the short table of a scripts/device_check.sh run: test counts and benchmark figures per version."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def main(folder: Path) -> None:
    device = (folder / "device.txt").read_text().strip() if (folder / "device.txt").exists() else "?"
    print(f"\ndevice: {device}")
    for xml in sorted(folder.glob("pytest-*.xml")):
        suite = ElementTree.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, failed = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
        skipped = int(suite.get("skipped"))
        print(f"megatron-core {xml.stem.removeprefix('pytest-')}: {total - failed - skipped} passed, {failed} failed, "
              f"{skipped} skipped")  # fmt: skip
    for bench in sorted(folder.glob("bench-*.json")):
        results = json.loads(bench.read_text())
        for shape_name, shape in results["shapes"].items():
            pinned, forward_ms = shape["pinned_copy"], shape["estimated_forward_per_micro_batch_s"] * 1e3
            print(
                f"\n{bench.stem} {shape_name}: forward/micro-batch ~{forward_ms:.0f} ms, "
                f"one-way copy {shape['one_way_copy_s'] * 1e3:.0f} ms; pinned d2h/h2d/both "
                f"{pinned['d2h_GBps']:.1f}/{pinned['h2d_GBps']:.1f}/{pinned['both_GBps']:.1f} GB/s"
            )
            print_variants(shape["variants"])
            if shape.get("capped"):
                print(f"under a cap of {shape['capped']['cap_GiB']:.2f} GiB (x base: to the uncapped no-offload run)")
                print_variants(shape["capped"]["variants"])
            if "acceptance" in shape:
                print("auto: " + ", ".join(f"{key} {value:.3f}" for key, value in shape["acceptance"].items()))


def print_variants(variants: dict) -> None:
    print(
        f"{'variant':26} {'step ms':>8} {'x base':>7} {'peak GiB':>9} {'peak -GiB':>9} {'reserved':>9} "
        f"{'exposed ms':>10} {'out/in GB/s':>12}"
    )
    for name, row in variants.items():
        if "error" in row:
            print(f"{name:26} did not run: {row['error'][:90]}")
            continue
        copies, exposed = "", ""
        if "copy_out_GBps" in row:
            copies = f"{row['copy_out_GBps']:.1f}/{row['copy_back_GBps']:.1f}"
            exposed = f"{row['exposed_s'] * 1e3:.1f}"
        print(
            f"{name:26} {row['median_step_s'] * 1e3:8.1f} {row['step_time_ratio']:7.3f} "
            f"{row['peak_allocated_GiB']:9.2f} {row['peak_saving_GiB']:9.2f} {row.get('peak_reserved_GiB', 0):9.2f} "
            f"{exposed:>10} {copies:>12}"
        )


def integration_table(folder: Path) -> None:
    """The table tests/drills/integration.py wrote, if it ran."""
    table = folder / "integration" / "table.txt"
    if table.exists():
        print("\nintegration runs\n" + table.read_text(), end="")


def probe_and_side_by_side(folder: Path) -> None:
    """The copy-order probe's figures and the Megatron-LM side-by-side table, if they ran."""
    probe = folder / "probe.json"
    if probe.exists():
        print("\ncopy-order probe (a 4-byte .item() right after a step)")
        for name, figures in json.loads(probe.read_text()).items():
            if isinstance(figures, dict):
                print(f"  {name:22} " + ", ".join(f"{key} {value:.2f}" for key, value in figures.items()))
    side = folder / "side" / "table.txt"
    if side.exists():
        print("\nMegatron-LM's loop, side by side\n" + side.read_text(), end="")


def trace_verdicts(folder: Path) -> None:
    """The trace bar (busy time within 3%, busy share where copies run within 10%) per profiled offload run
    (the trace part, or side with --profile): one line
    each, the worst iteration's figures, so the verdict needs no reading of the trace table."""
    for summaries in sorted(folder.glob("*/trace_summary.json")):
        print(f"\ntrace summary ({summaries.parent.name}/): compute-stream busy time and busy share where copies run, "
              "each against its base's trace; profiled runs, not timings")  # fmt: skip
        for name, summary in json.loads(summaries.read_text()).items():
            if "error" in summary:
                print(f"  {name:26} no summary: {summary['error'][:90]}")
                continue
            iterations = summary["iterations"]
            busy = [it["busy_ratio"] for it in iterations]
            shares = [it["share_ratio"] for it in iterations if it["share_ratio"] is not None]
            share = f"share in copy windows x{min(shares):.2f}" if shares else "no copy windows"
            print(f"  {name:26} vs {summary['base_run']:20} busy x{min(busy):.3f}-{max(busy):.3f}, {share}: "
                  f"{summary['verdict']}")  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    probe_and_side_by_side(Path(sys.argv[1]))
    trace_verdicts(Path(sys.argv[1]))
    integration_table(Path(sys.argv[1]))
