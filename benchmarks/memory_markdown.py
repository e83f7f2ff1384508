"""The nightly memory comparison's Markdown page (report.md), from the report compare_memory.py builds."""

from __future__ import annotations

from typing import Any

from benchmarks.memory_summary import WARMUP_ITERATIONS


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _run_rows(report: dict[str, Any]) -> list[str]:
    """One table row per run: status, time against no offload and the floor, memory, the offload fields."""
    runs, floors = report["runs"], report["measured"].get("floors", {})
    base_ms = report["measured"].get("no_offload_ms")  # both no-offload runs where the second ran (memory_checks)
    lines = [
        "| run | flags | status | median step ms (quartiles) | x no offload | floor ms | threshold ms "
        "| peak allocated GiB | peak reserved GiB | offloaded GiB/rank | link out/back GB/s | host pace ms (slow) "
        "| final loss |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, run in runs.items():
        s, floor = run["summary"], floors.get(name, {})
        status = s["status"] if s["status"] == "ok" else f"{s['status']}: {s['detail']}".replace("|", "/")
        ratio = s["median_step_ms"] / base_ms if s["median_step_ms"] and base_ms else None
        links = [floor.get("link_out_gbps"), floor.get("link_in_gbps")]
        link = "—" if None in links else f"{links[0]:.1f}/{links[1]:.1f}"
        flags = " ".join(run.get("flags", [])) or "—"
        spread = s.get("quartile_step_ms")
        median = _cell(s["median_step_ms"], ".1f") + (f" ({spread[0]:.0f}-{spread[1]:.0f})" if spread else "")
        pace, slow = s.get("host_pace_ms"), s.get("host_slow_share")
        host = "—" if pace is None else f"{pace:.2f} ({slow:.0%})"
        lines.append(
            f"| {name} | `{flags}` | {status} | {median} | {_cell(ratio, '.3f')} | "
            f"{_cell(floor.get('floor_ms'), '.1f')} | {_cell(floor.get('threshold_ms'), '.1f')} | "
            f"{_cell(s['peak_gib'], '.2f')} | {_cell(s['max_reserved_gib'], '.2f')} | "
            f"{_cell(s['offloaded_gib'], '.2f')} | {link} | {host} | "
            f"{_cell(s['final_loss'], '.6E')} |"
        )
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The human page: one row per run, the state and the cap, each check, then the notes."""
    env, measured = report["environment"], report["measured"]
    state, cap = measured.get("state_gib"), measured.get("cap_gib")
    lines = [
        "# Nightly memory comparison",
        "",
        f"On {env.get('device') or 'an unknown device'} ({report['gpus']} GPU), torch {env.get('torch')}, "
        f"megatron-core {env.get('megatron_core')}, commit {env.get('commit')}; config `{report['config']}`; "
        f"medians over the iterations after the first {WARMUP_ITERATIONS}, peaks at the last iteration.",
        "",
        f"Optimizer state per rank: {_cell(state, '.2f', ' GiB')} ({report['state_how']}). "
        f"Cap of the capped rows: {_cell(cap, '.2f', ' GiB')} (no offload's peak reserved less "
        f"{report['cap_state_share']:g} of the state).",
        "",
        *_run_rows(report),
        "",
        "A row's floor: no offload's step time (x no offload's too: over both no-offload runs, before and after "
        "the offload rows, where the second ran through) plus the time its offloaded bytes take out and back over the "
        "links it measured, less the compute each way can hide behind (out: the first micro-batch's forward; "
        "back: the last backward for the default, nothing for step, which brings the state back in the step); "
        f"its threshold: the floor times {1 + report['thresholds']['max_time_over_floor']:g}. Host pace: a fixed "
        "Python loop timed once a second beside the runs, its median over a row's steady iterations and the "
        "share of them slower than 1.3x the night's fast level; rows at different paces do not compare.",
        "",
        "## Checks",
        "",
        "| check | threshold | measured | result | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in report["checks"]:
        result = "PASS" if c["passed"] else "FAIL"
        lines.append(f"| {c['name']} | {c['threshold']} | {c['measured']} | {result} | {c['detail']} |")
    lines += ["", f"**Overall: {report['verdict']}**", ""]
    if report["notes"]:
        lines += ["## Notes", "", *(f"- {note}" for note in report["notes"]), ""]
    return "\n".join(lines)
