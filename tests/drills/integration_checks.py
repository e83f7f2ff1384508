"""What the integration runs (integration.py) read from a run's log and check of an entry's runs: losses equal to the
entry's first run (or, resumed, to the run that saved), no GPU memory growth during a save, 12 bytes per parameter
shard offloaded, peak reserved under a capped entry's cap; the cap itself, and the table of entries."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from benchmarks.memory_report import GIB, MIB, expected_state_bytes
from benchmarks.memory_report import parse_log as parse_megatron_log
from megatron_offload.core.units import cap_below_peak

if TYPE_CHECKING:
    from tests.drills.integration import Entry

__all__ = ["cap_from", "check", "parse_log", "render_table"]


def parse_log(text: str) -> dict:
    """What the checks read from one run's log (Megatron's lines parsed by memory_report.parse_log)."""
    log = parse_megatron_log(text)
    rank = log.memory_rank
    memory = log.memory[rank][max(log.memory[rank])] if rank is not None else None
    last = log.steps[max(log.steps)] if log.steps else None
    offloaded = last is not None and last.offloaded_gib is not None
    state, _ = expected_state_bytes(log, master_weights="--no-offload-master-weights" not in text)
    return {
        "losses": {i: step.loss for i, step in log.steps.items() if step.loss is not None},
        "max_allocated_MiB": memory.max_allocated if memory else None,
        "max_reserved_MiB": memory.max_reserved if memory else None,
        "expected_state_GiB": state / GIB if state else None,
        "offloaded_GiB_per_rank": last.offloaded_gib if offloaded else None,
        "copy_out_in_exposed_ms": [last.copy_out_ms, last.copy_in_ms, last.exposed_ms] if offloaded else None,
        # Megatron reports memory "(before save_checkpoint ...)" and "(after ...)" around every save.
        "save_allocated_MiB": [float(x) for x in re.findall(r"save_checkpoint.*?allocated: ([\d.]+)", text)],
    }


def check(entry: Entry, results: dict[str, dict]) -> list[str]:
    """Failures, as sentences; empty when the entry passed."""
    failures = [r["verdict"] for r in results.values() if r.get("stopped")]
    failures += [f"{name} exited {r['returncode']}" for name, r in results.items() if r["returncode"] not in (0, None)]
    if failures:
        return failures
    first_name, first = next(iter(results.items()))
    for name, result in results.items():
        if not result["losses"]:
            failures.append(f"{name}: no losses in the log")
        common = sorted(first["losses"].keys() & result["losses"].keys())
        if entry.resume_from is None and result["losses"] != first["losses"]:
            failures.append(f"{name}: losses differ from {first_name}")
        resumed = entry.resume_from is not None and name != entry.resume_from
        if resumed and (not common or any(first["losses"][i] != result["losses"][i] for i in common)):
            failures.append(f"{name}: resumed losses differ from the uninterrupted run at {common}")
    for name, result in results.items():
        saves = result["save_allocated_MiB"]
        if result["offloaded_GiB_per_rank"] and len(saves) >= 2 and saves[1] > saves[0] + 1:
            failures.append(f"{name}: GPU memory grew during the save ({saves[0]:.0f} -> {saves[1]:.0f} MiB)")
        offloaded, expected = result["offloaded_GiB_per_rank"], result.get("expected_state_GiB")
        # The log line rounds to 0.01 GiB; bucket padding adds a little.
        if offloaded and expected and not expected - 0.01 <= offloaded <= 1.02 * expected + 0.01:
            failures.append(f"{name}: {offloaded} GiB offloaded per rank, expected {expected:.2f} (12 B/param)")
        cap = result.get("cap_GiB")
        if cap is not None and result.get("max_reserved_MiB") and result["max_reserved_MiB"] * MIB > cap * GIB:
            failures.append(f"{name}: peak reserved {result['max_reserved_MiB']:.0f} MiB above the {cap:.2f} GiB cap")
    return failures


def cap_from(baseline: dict) -> float | None:
    """The cap a capped entry's offload runs get: the baseline's peak allocated less 90% of the state."""
    if baseline.get("max_allocated_MiB") is None or baseline.get("expected_state_GiB") is None:
        return None
    return cap_below_peak(baseline["max_allocated_MiB"] * MIB / GIB, baseline["expected_state_GiB"])


def render_table(summary: dict) -> str:
    """One line per entry: runs, iterations, peak memory of each run, GiB offloaded per rank, verdict."""
    lines = [
        f"{'entry':32} {'GPUs':>4} {'iters':>5} {'peak MiB (runs)':>20} {'GiB/rank':>8} {'exposed ms':>10}  verdict"
    ]
    for name, item in summary.items():
        runs = list(item["runs"].values())
        peaks = "/".join(f"{r.get('max_allocated_MiB') or 0:.0f}" for r in runs)
        offloaded = next((r for r in runs if r.get("offloaded_GiB_per_rank")), None)
        gib, exposed = (
            (offloaded["offloaded_GiB_per_rank"], offloaded["copy_out_in_exposed_ms"][2]) if offloaded else (0, 0)
        )
        iters = max((len(r.get("losses", {})) for r in runs), default=0)
        verdict = item.get("verdict") or ("ok" if not item["failures"] else "FAIL: " + "; ".join(item["failures"]))
        lines.append(f"{name:32} {item['gpus']:>4} {iters:>5} {peaks:>20} {gib:>8.3f} {exposed:>10.1f}  {verdict}")
    return "\n".join(lines) + "\n"
