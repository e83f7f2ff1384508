"""The runs of the memory-speed sweep (``megatron_side_by_side.py --sweep``): the uncapped no-offload run (and
upstream's), then ours under each cap; each cap's cells, the link and first forward the floor uses, then
curve.json and curve.png, written as each cap's runs end. What the curve is, which cells run and which follow
from an uncapped run, and the floor: memory_speed_curve.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from benchmarks.memory_report import GIB, copy_gbps
from benchmarks.memory_speed_curve import (
    DEFAULT_LINK_GBPS,
    NO_OFFLOAD,
    OURS,
    STEP_FLAGS,
    STEP_ROW,
    UPSTREAM_ROW,
    cap_blind,
    cap_plan,
    cell,
    estimate_s,
    floor_ratio,
    iterations_for,
    median_ms,
    plot,
    pooled_cell,
)
from benchmarks.side_by_side_rounds import in_turn

# Why a row run once uncapped has no run under a cap its uncapped peaks straddle.
WHY_UNCAPPED = {UPSTREAM_ROW: "our cap flag cannot reach upstream's script", STEP_ROW: "it runs once, uncapped"}


def run_sweep(
    args: Any,
    clients: dict[str, list[str]],
    env: dict,
    run: Callable[..., dict],
    flags: dict[str, list[str]],
    head: dict[str, Any],
) -> dict[str, Any]:
    """The sweep: uncapped no offload (and upstream), then ours under each cap; with ``--rounds N``, no offload
    and ours under each cap N - 1 times more, in turn (``in_turn``: every second round in reverse), each row's
    iterations pooled over its rounds (the machine's pace drifts over a call: every row then spans it alike).
    JSON and plot after each cap and each round. ``run`` is the harness's job runner; ``flags`` its "ours" and
    "upstream" offload flags."""
    interval = args.log_intervals[0]
    iters, window = iterations_for(interval)
    tail = ["--train-iters", str(iters), "--log-interval", str(interval), "--log-memory-interval", str(iters)]
    tail += ["--global-batch-size", str(args.global_batch)] if args.global_batch else []
    tail += list(args.extra)
    gb = f"gb{args.global_batch or 'cfg'}" + (f"-log{interval}" if interval > 1 else "")
    result: dict[str, Any] = {**head, "global_batch": args.global_batch, "log_interval": interval,
                              "train_iters": iters, "median_of_iterations": list(window), "caps": [],
                              "runs": {}}  # fmt: skip
    result["base"] = "ours, no offload, uncapped (upstream's rows too: same model and flags)"
    result["floor"] = "1 + max(0, X / link - first forward) / iteration (X: the cap's saved bytes)"

    def go(name: str, argv: list[str], extra_env: dict | None = None) -> dict[str, Any]:
        figures = run(f"sweep-{gb}-{name}", argv, args.gpus, args.out, extra_env)
        result["runs"][name] = {k: v for k, v in figures.items() if k not in ("losses", "step_ms_per_interval")}
        return figures

    base_run = go("no-offload", [*clients["ours"], *tail])
    if "error" in base_run or median_ms(base_run, window) is None or "peak_reserved_GiB" not in base_run:
        result["error"] = f"the uncapped no-offload run gave no figures: {base_run.get('error', 'no peak')}"
        return result
    megatron = base_run.get("megatron_args", {})
    dp = int(megatron.get("data_parallel_size", 1) or 1)
    mbs, gbs = int(megatron.get("micro_batch_size", 2)), int(megatron.get("global_batch_size", args.global_batch or 8))
    micro_batches = max(1, gbs // (mbs * dp))
    state_gib = args.state_gib or 12 * base_run.get("parameters", 0) / dp / GIB
    result |= {
        "micro_batches": micro_batches,
        "rounds": args.rounds,
        "state": {
            "GiB": state_gib,
            "source": "--state-gib"
            if args.state_gib
            else "12 bytes x Megatron's parameter count (no-offload run) / data-parallel size",
        },  # fmt: skip
        "estimate_s": estimate_s(len(args.caps), micro_batches, "upstream" in clients, args.rounds, args.step_row),
    }
    if not state_gib:
        result["error"] = "no parameter count in the no-offload run's log: give --state-gib"
        return result
    upstream_run = None
    if "upstream" in clients:
        upstream_run = go("upstream", [*clients["upstream"], *tail, *flags["upstream"]], env)
    step_run = go("step", [*clients["ours"], *tail, *flags["ours"], *STEP_FLAGS]) if args.step_row else None
    link = base_run.get("link_GBps") or (upstream_run or {}).get("link_GBps")
    copied: list[float] = []  # the link each of our capped runs' copies out measured, GB/s
    runs: dict[str, list[dict[str, Any]]] = {NO_OFFLOAD: [base_run]}  # each row's runs, round after round
    capped_no_offload: dict[int, dict[str, Any]] = {}  # the caps where no offload ran (first round only)

    def ours(plan: dict[str, float], suffix: str = "") -> None:
        capped = ["--offload-gpu-memory-cap-gib", f"{plan['cap_GiB']:.3f}"]
        for name, extra in OURS.items():
            argv = [*clients["ours"], *tail, *flags["ours"], *extra, *capped]
            figures = go(f"cap{plan['percent']}-{name.split()[0]}{suffix}", argv)
            runs.setdefault(f"{plan['percent']}:{name}", []).append(figures)
            copied.extend(copy_out_gbps(figures))

    def tabulate(plans: list[dict[str, float]]) -> None:
        """Every row so far against no offload's runs so far, the floor, then the JSON and the plot."""
        pooled = pooled_cell(runs[NO_OFFLOAD], None, window)["ms_per_iter"]
        base = {"ms_per_iter": pooled, "losses": base_run["losses"]}
        result["no_offload"] = pooled_cell(runs[NO_OFFLOAD], base, window) | {"x_no_offload": 1.0}
        if step_run is not None:
            result["step"] = cell(step_run, base, window)
        result["caps"] = []
        for plan in plans:
            cap = plan["cap_GiB"]
            rows = {name: pooled_cell(runs[f"{plan['percent']}:{name}"], base, window) for name in OURS}
            for name, once in ((UPSTREAM_ROW, upstream_run), (STEP_ROW, step_run)):  # uncapped runs, cap-blind
                if once is not None:
                    rows[name] = cap_blind(once, cap, cell(once, base, window)) or {
                        "outcome": "not run",
                        "reason": f"its uncapped peaks straddle the cap; {WHY_UNCAPPED[name]}",
                    }
            ran = capped_no_offload.get(plan["percent"])
            if ran is None:  # its uncapped run tells
                rows[NO_OFFLOAD] = cap_blind(base_run, cap, result["no_offload"])
            else:
                rows[NO_OFFLOAD] = cell(ran, base, window)
            result["caps"].append(plan | {"rows": rows})
        result["caps"].sort(key=lambda c: c["percent"])
        logged = link or next((f["link_GBps"] for rows in runs.values() for f in rows if f.get("link_GBps")), None)
        finish(result, logged, args.first_forward_ms or pooled / micro_batches / 3, args, copied)

    plans = cap_plan(base_run["peak_reserved_GiB"], state_gib, args.caps)
    for index, plan in enumerate(plans):
        ours(plan)
        if args.run_every_cell or cap_blind(base_run, plan["cap_GiB"], {}) is None:
            argv = [*clients["ours"], *tail, "--offload-gpu-memory-cap-gib", f"{plan['cap_GiB']:.3f}"]
            capped_no_offload[plan["percent"]] = go(f"cap{plan['percent']}-no-offload", argv)
        tabulate(plans[: index + 1])
    for round_ in range(2, args.rounds + 1):  # the same runs again, every second round in reverse
        for plan in in_turn([None, *plans], round_):
            if plan is None:
                runs[NO_OFFLOAD].append(go(f"no-offload-round{round_}", [*clients["ours"], *tail]))
            else:
                ours(plan, f"-round{round_}")
        tabulate(plans)
    return result


def failed_rows(result: dict[str, Any]) -> list[str]:
    """Our rows that did not run or whose losses differ from no offload's: under each cap, and the step row."""
    rows = [(f"cap {plan['percent']}%: {name}", plan["rows"][name]) for plan in result["caps"] for name in OURS]
    rows += [(f"{STEP_ROW}, uncapped", result["step"])] if "step" in result else []
    return [name for name, row in rows if row["outcome"] != "ran" or row.get("losses_equal") is False]


def copy_out_gbps(figures: dict[str, Any]) -> list[float]:
    """The link one of our runs measured: its offloaded bytes over its copy-out time (GB/s); none where it
    moved nothing or logged no copy time."""
    link = copy_gbps((figures.get("offloaded_GiB") or 0) * GIB, (figures.get("copy_out_in_ms") or [None])[0])
    return [link] if link else []


def finish(result: dict[str, Any], link: float | None, forward_ms: float, args: Any, copied: list[float]) -> None:
    """The link and first forward used, each cap's floor, then the JSON and the plot, written now."""
    import json

    if link:
        result["link"] = {"GBps": link, "source": "logged by a run of this sweep"}
    elif copied:
        result["link"] = {
            "GBps": statistics.median(copied),
            "source": f"our copies out in this sweep (median of "
            f"{len(copied)} run{'s' if len(copied) > 1 else ''}: offloaded bytes / copy-out time)",
        }
    else:
        result["link"] = {"GBps": args.link_gbps, "source": f"not measured in this run: --link-gbps {args.link_gbps:g}"
                          + (" (the default)" if args.link_gbps == DEFAULT_LINK_GBPS else "")}  # fmt: skip
    source = "--first-forward-ms" if args.first_forward_ms else "no-offload ms/iter / micro-batches / 3"
    result["first_forward"] = {"ms": forward_ms, "source": source}
    for plan in result["caps"]:
        plan["floor_x"] = floor_ratio(plan["saved_GiB"] * GIB, result["link"]["GBps"], forward_ms,
                                      result["no_offload"]["ms_per_iter"])  # fmt: skip
        for row in plan["rows"].values():  # each run's distance to the floor; a derived cell is an uncapped run
            if row.get("x_no_offload") is not None and "derived" not in row:
                row["x_floor"] = row["x_no_offload"] / plan["floor_x"]
    result["plot"] = plot(result, args.out / "curve.png")
    (args.out / "curve.json").write_text(json.dumps(result, indent=1, default=str))
