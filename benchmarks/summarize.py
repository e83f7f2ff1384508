"""Print the short table of a scripts/device_check.sh run: test counts and benchmark figures per version."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def main(folder: Path) -> None:
    device = (folder / "device.txt").read_text().strip() if (folder / "device.txt").exists() else "?"
    print(f"\ndevice: {device}")
    header = "mcore    tests(pass/fail/skip)  freed GB  d2h GB/s (of pinned)  h2d GB/s (of pinned)  step x  peak -GiB"
    print(header)
    for xml in sorted(folder.glob("pytest-*.xml")):
        version = xml.stem.removeprefix("pytest-")
        suite = ElementTree.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, failed = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
        skipped = int(suite.get("skipped"))
        tests = f"{total - failed - skipped}/{failed}/{skipped}"
        bench = folder / f"bench-{version}.json"
        if not bench.exists():
            print(f"{version:8} {tests:22} (no benchmark)")
            continue
        b = json.loads(bench.read_text())
        d2h = f"{b['offload_GBps']:.1f} ({b['offload_fraction_of_pinned_d2h']:.0%})"
        h2d = f"{b['prefetch_GBps']:.1f} ({b['prefetch_fraction_of_pinned_h2d']:.0%})"
        print(
            f"{version:8} {tests:22} {b['offload']['offloaded_GB']:8.2f}  {d2h:20}  {h2d:20}  "
            f"{b['step_time_ratio']:6.3f}  {b['peak_saving_GiB']:.2f}"
        )


def integration_table(folder: Path) -> None:
    path = folder / "integration" / "integration.json"
    if not path.exists():
        return
    print("\nintegration entry                 GPUs  peak MiB per run         GiB/rank  exposed ms  verdict")
    for name, item in json.loads(path.read_text()).items():
        runs = list(item["runs"].values())
        peaks = "/".join(f"{r['max_allocated_MiB'] or 0:.0f}" for r in runs)
        gib = next((r["offloaded_GiB_per_rank"] for r in runs if r["offloaded_GiB_per_rank"]), 0)
        exposed = next((r["copy_out_in_exposed_ms"][2] for r in runs if r["copy_out_in_exposed_ms"]), 0)
        verdict = "ok" if not item["failures"] else "FAIL: " + "; ".join(item["failures"])
        print(f"{name:33} {item['gpus']:4}  {peaks:23}  {gib:8.3f}  {exposed:10.1f}  {verdict}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    integration_table(Path(sys.argv[1]))
