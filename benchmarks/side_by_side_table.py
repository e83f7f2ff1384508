"""megatron_side_by_side.py's table (table.txt and what it prints): per log interval each row's ms/iter, its
ratio to its base, peaks, cap, exposed copy time, whether its losses equal its base's, each round's median
(``--rounds``) and the host's pace (host_pace.py); then the profiled runs and their trace comparison."""

from __future__ import annotations

from typing import Any

from benchmarks.host_pace import pace_text
from benchmarks.pooled_rows import rounds_text
from benchmarks.side_by_side_rows import UPSTREAM_BASE
from benchmarks.trace_summary import table as trace_table


def table(results: dict[str, Any]) -> str:
    """Per log interval: ms/iter, the ratio to its base, peaks, exposed copy time, losses; then the
    profiled runs' trace comparison, if any."""
    head = f"{'run':26} {'ms/iter':>8} {'x base':>7} {'peak alloc':>10} {'peak resv':>10} {'cap':>6} {'exposed':>8}"
    lines = [f"{results.get('client', '')}, {results.get('config', '')}, commit {results.get('commit', '')}"]
    if results.get("upstream"):
        lines.append(
            f"upstream: {results['upstream']['path']}'s own pretrain_gpt.py and loop; x base and losses of its "
            f"rows are to '{UPSTREAM_BASE}', ours to 'no offload'"
        )
    for section, runs in results["runs"].items():
        lines += ["", section, head + "  losses"]
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"{name:26} did not run: {r['error'][:100]}")
                continue
            equal = "equal" if r.get("losses_equal", True) else "DIFFER"
            exposed = "-" if r.get("exposed_ms") is None else f"{r['exposed_ms']:.1f}"  # upstream logs none
            lines.append(
                f"{name:26} {r['step_ms']:8.1f} {r.get('x_base', 1):7.3f} {r.get('peak_allocated_GiB', 0):10.2f} "
                f"{r.get('peak_reserved_GiB', 0):10.2f} {r.get('cap_GiB', 0):6.2f} {exposed:>8}"
                f"  {equal}{rounds_text(r, 'step_ms_per_round')}{pace_text(r)}"
            )
    if "profiled" in results:
        lines += ["", f"profiled: {results['profiled']['note']}"]
        for name, r in results["profiled"]["runs"].items():
            outcome = f"did not run: {r['error'][:100]}" if "error" in r else f"trace {r['trace']}"
            lines.append(f"{name:26} {outcome}")
        lines += ["", "trace comparison (trace_summary.py), each against its base's trace"]
        lines.append(trace_table(results.get("trace", {})).rstrip("\n"))
    return "\n".join(lines) + "\n"
