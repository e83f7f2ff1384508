"""The memory-speed curve of ``megatron_side_by_side.py --sweep``: GPU memory caps at the no-offload
peak reserved less a share of the optimizer state, one row per way of training, and the floor.

Rows: ours by default (``--offload-optimizer-states`` alone: only what the cap requires leaves the GPU),
upstream's chunked offloader (Megatron-LM dev, its own loop; with ``--upstream-megatron-lm``) and no offload. The
state is 12 bytes a parameter (fp32 master, Adam's two moments) of Megatron's own parameter count in the
uncapped no-offload run, divided over data-parallel ranks. The sweep runs at the first of ``--log-intervals``;
each cell's ms/iter is the median of iterations 3-24 at interval 1, of the lines from iteration 2k of 8k at
interval k (``iterations_for``); its ratio is to the uncapped no-offload run of the same invocation.

Runs: one uncapped no-offload run, one uncapped upstream run, and ours once per cap. Neither no offload
nor upstream's offloader reads the cap: under a cap at or above a row's uncapped peak reserved the
allocator never reaches it (the run is the uncapped one), and under a cap below its uncapped peak
allocated it cannot fit; those cells are taken from the uncapped run and say so (``derived``).
Only a cap in between needs a run (ours no offload under the cap; upstream's, which our cap flag cannot
reach, stays "not run"). ``--run-every-cell`` runs no offload under every cap anyway.

The floor: under a cap that needs X bytes of state off the GPU at the activation peak, with gradient
clipping on (the step starts only after the last backward), those X bytes cross out after the step and
before the first micro-batch's forward reaches its peak: at best 1 + max(0, X / link - first forward) /
iteration. The link is the one a run's log states, else the one our capped runs' copies out measured
(offloaded bytes over copy-out time, the median of the runs), else ``--link-gbps`` (52 GB/s by default,
said so in the JSON); the first forward a third of a micro-batch's share of the no-offload iteration (forward is
about a third of forward and backward), else ``--first-forward-ms``.

Each row also says the host's pace over its counted iterations (host_pace.py): Megatron's forwards are host-bound
on the lent machines, whose pace flips between two levels; rows that ran at different paces do not compare.
Here: the caps, the floor, the cells and the curve's plot and text; the runs that fill it: memory_speed_sweep.py.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks import phase_lines
from benchmarks.host_pace import pace_text, pooled_pace
from benchmarks.memory_report import GB, GIB
from benchmarks.pooled_rows import highest_peaks, pooled_medians, retries_text, retry_figures, rounds_text

DEFAULT_CAPS = (90, 50, 0, 75, 25)  # most telling first: a call cut off at its limit still leaves a curve
DEFAULT_LINK_GBPS = 52.0
# ms/iter: the median of iterations 3-24. Single iterations in Megatron-LM's loop spread by about 10%, also
# without offloading: 22 of them put the median within about 2%.
SWEEP_ITERS, MEDIAN_FROM = 24, 3
NO_OFFLOAD, UPSTREAM_ROW = "no offload", "upstream chunked offload"
OURS = {"default": []}  # the flags after --offload-optimizer-states of each of our rows
# --step-row: ours with the whole state off the GPU at the peak, once uncapped (beside upstream's chunked row)
STEP_ROW, STEP_FLAGS = "prefetch step", ["--offload-prefetch", "step"]
LOSSES = {True: "losses equal", False: "losses DIFFER", None: ""}  # a row's losses_equal, in its line
# Wall-time model of one run (s): start-up, then iterations; the first two iterations ~2 s more.
STARTUP_S = {"no offload": 25.0, "ours": 50.0, "upstream": 45.0}
MICRO_BATCH_S, STEP_S, OFFLOAD_EXTRA_S = 0.15, 0.05, 0.3


def cap_plan(peak_reserved_gib: float, state_gib: float, percents: list[int]) -> list[dict[str, float]]:
    """Each cap: the no-offload peak reserved less ``percent`` of the state; saved = that share in GiB."""
    return [
        {"percent": p, "saved_GiB": p / 100 * state_gib, "cap_GiB": peak_reserved_gib - p / 100 * state_gib}
        for p in percents
    ]


def floor_ratio(saved_bytes: float, link_gbps: float, first_forward_ms: float, iteration_ms: float) -> float:
    """At best 1 + max(0, X / link - first forward) / iteration: X bytes cross out between the step and
    the first forward's activation peak."""
    crossing_ms = saved_bytes / (link_gbps * GB) * 1e3
    return 1 + max(0.0, crossing_ms - first_forward_ms) / iteration_ms


Window = tuple[int, int]  # the first and last logged iteration a median counts
AT_INTERVAL_1: Window = (MEDIAN_FROM, SWEEP_ITERS)


def iterations_for(interval: int) -> tuple[int, Window]:
    """Iterations to run at ``--log-interval interval`` and the logged ones the median counts: at 1, 24
    and iterations 3-24; at k > 1, 8k and the lines from 2k on (each line is the mean of the k iterations
    before it, and the first line's hold the slow first two)."""
    if interval <= 1:
        return SWEEP_ITERS, AT_INTERVAL_1
    return 8 * interval, (2 * interval, 8 * interval)


def in_window(figures: dict[str, Any], key: str, window: Window) -> list[float]:
    """The values of ``figures[key]`` (by logged iteration) whose iteration is in ``window``."""
    return [v for _, v in window_items(figures, key, window)]


def window_items(figures: dict[str, Any], key: str, window: Window) -> list[tuple[str, Any]]:
    """The (logged iteration, value) pairs of ``figures[key]`` whose iteration is in ``window`` and value is set."""
    first, last = window
    return [(i, v) for i, v in (figures.get(key) or {}).items() if first <= int(i) <= last and v is not None]


def median_ms(figures: dict[str, Any], window: Window = AT_INTERVAL_1) -> float | None:
    """The median ms/iter of the logged iterations in ``window`` that ran (3-24 at --log-interval 1)."""
    counted = in_window(figures, "step_ms_by_iteration", window)
    return statistics.median(counted) if counted else None


def estimate_s(n_caps: int, micro_batches: int, upstream: bool, rounds: int = 1, step: bool = False) -> float:
    """Expected wall time of a sweep: per round one no-offload run and each of ours once per cap; upstream once,
    and ``step`` (``--step-row``) once."""
    iteration = MICRO_BATCH_S * micro_batches + STEP_S
    one = {kind: start + 2 + SWEEP_ITERS * iteration for kind, start in STARTUP_S.items()}
    offload = SWEEP_ITERS * OFFLOAD_EXTRA_S
    ours = len(OURS) * n_caps * (one["ours"] + offload)
    once = (one["upstream"] + offload) * upstream + (one["ours"] + offload) * step
    return rounds * (one["no offload"] + ours) + once


def cell(figures: dict[str, Any], base: dict[str, Any] | None, window: Window = AT_INTERVAL_1) -> dict[str, Any]:
    """A row's figures under one cap: ms/iter, its ratio to no offload, peaks, losses, or why it did not run."""
    return pooled_cell([figures], base, window)


def pooled_cell(
    runs: list[dict[str, Any]], base: dict[str, Any] | None, window: Window = AT_INTERVAL_1
) -> dict[str, Any]:
    """One row from its runs in every round (``--rounds``): the median of all their timed iterations and
    each round's own, the highest peaks, every retry, whether each run's losses equal no offload's; the
    first round's other figures. A run that did not run makes the row's outcome."""
    failed = next((figures for figures in runs if "error" in figures), None)
    if failed is not None:
        outcome = "did not fit" if failed.get("did_not_fit") else "failed"
        return {"outcome": outcome, "reason": failed["error"]}
    per_run = [in_window(figures, "step_ms_by_iteration", window) for figures in runs]
    counted = [ms for values in per_run for ms in values]
    ms, per_round = pooled_medians(per_run)
    row: dict[str, Any] = {"outcome": "ran", "ms_per_iter": ms}
    if len(runs) > 1:  # how far the rounds' own medians lie apart: the machine's drift over the call
        row["ms_per_round"] = per_round
    if len(counted) >= 4:  # how far single lines spread around the median: the quartiles
        quartiles = statistics.quantiles(counted, n=4)
        row["ms_quartiles"] = [quartiles[0], quartiles[2]]
    for key in ("offloaded_GiB", "link_GBps", "wall_s", "phases_ms"):
        if runs[0].get(key) is not None:
            row[key] = runs[0][key]
    row |= highest_peaks(runs) | pooled_pace(runs)
    # The caching allocator ran short under the cap in the timed lines (each retry a stall), and what that cost.
    row |= retry_figures(
        [
            ((figures.get("allocator_retries_by_iteration") or {}).get(i), ms)
            for figures in runs
            for i, ms in window_items(figures, "step_ms_by_iteration", window)
        ]
    )
    streamed = [g for figures in runs for g in in_window(figures, "streamed_GiB_by_iteration", window)]
    if streamed:  # the state that came back through the step rather than during the last backward
        row["streamed_in_step_GiB"] = statistics.median(streamed)
    if base and ms is not None and base.get("ms_per_iter"):
        row["x_no_offload"] = ms / base["ms_per_iter"]
        row["losses_equal"] = all(figures.get("losses") == base.get("losses") for figures in runs)
    return row


def cap_blind(figures: dict[str, Any], cap: float, row: dict[str, Any]) -> dict[str, Any] | None:
    """A row that does not read the cap, from its uncapped run: the same run when the cap is at or above
    its peak reserved, "did not fit" when below its peak allocated; None when only a run can tell."""
    reserved, allocated = figures.get("peak_reserved_GiB"), figures.get("peak_allocated_GiB")
    if "error" in figures or reserved is None or allocated is None:
        return None
    if cap >= reserved:
        return row | {"derived": f"its uncapped run reserved at most {reserved:.2f} GiB: the cap never acts"}
    if cap < allocated:
        return {"outcome": "did not fit", "derived": f"its uncapped run held {allocated:.2f} GiB at once",
                "reason": f"peak allocated {allocated:.2f} GiB > cap {cap:.2f} GiB"}  # fmt: skip
    return None


def plot(result: dict[str, Any], path: Any) -> str:
    """x: GPU memory saved (GiB), y: time ratio to no offload, a line per row and the floor; the PNG's
    file name, or one line saying why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib); the JSON has every figure"
    caps = result["caps"]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(name for plan in caps for name in plan["rows"]))
    for name in names:
        points = [(p["saved_GiB"], p["rows"][name].get("x_no_offload")) for p in caps if name in p["rows"]]
        ran = [(x, y) for x, y in points if y is not None]
        line = axes.plot(*zip(*ran, strict=True), marker="o", label=name)[0] if ran else None
        for x, y in points:
            if y is None:
                axes.annotate("did not fit", (x, 1.0), rotation=90, fontsize=7, va="bottom", ha="center",
                              color=line.get_color() if line else "grey")  # fmt: skip
    if caps:
        top = max(p["saved_GiB"] for p in caps)
        xs = [top * i / 50 for i in range(51)]
        link, forward = result["link"]["GBps"], result["first_forward"]["ms"]
        ys = [floor_ratio(x * GIB, link, forward, result["no_offload"]["ms_per_iter"]) for x in xs]
        axes.plot(xs, ys, "k--", label=f"floor ({link:.0f} GB/s link)")
    axes.set_xlabel("GPU memory saved (GiB)")
    axes.set_ylabel("time per iteration / no offload")
    axes.set_title(f"global batch {result.get('global_batch') or 'of the config'}, "
                   f"{result.get('micro_batches', '?')} micro-batches")  # fmt: skip
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path.name


def table(result: dict[str, Any]) -> str:
    """The curve as text: per cap, each row's ms/iter and ratio (or why not), and the floor."""
    lines = [f"memory-speed curve, global batch {result.get('global_batch') or 'of the config'} "
             f"({result.get('micro_batches')} micro-batches), --log-interval {result.get('log_interval', 1)}, "
             f"state {result['state']['GiB']:.2f} GiB, "
             f"no offload {result['no_offload']['ms_per_iter']:.1f} ms/iter{rounds_text(result['no_offload'])}"
             f"{pace_text(result['no_offload'])}, "
             f"link {result['link']['GBps']:.1f} GB/s "
             f"({result['link']['source']})"]  # fmt: skip
    step = result.get("step")
    if step and step.get("outcome") == "ran":  # --step-row: uncapped, the whole state off the GPU at the peak
        lines.append(f"{STEP_ROW}, uncapped: {step['ms_per_iter']:.1f} ms  x{step.get('x_no_offload', 0):.3f}  "
                     f"peak reserved {step.get('peak_reserved_GiB', 0):.2f} GiB  "
                     f"{LOSSES[step.get('losses_equal')]}{pace_text(step)}")  # fmt: skip
    elif step:
        lines.append(f"{STEP_ROW}, uncapped: {step.get('outcome')}: {step.get('reason', '')[:100]}")
    for plan in result["caps"]:
        lines.append(f"cap {plan['percent']}% ({plan['cap_GiB']:.2f} GiB, saves {plan['saved_GiB']:.2f} GiB): "
                     f"floor x{plan['floor_x']:.3f}")  # fmt: skip
        for name, row in plan["rows"].items():
            if row["outcome"] != "ran":
                lines.append(f"  {name:26} {row['outcome']}: {row.get('reason', '')[:100]}")
                continue
            equal = LOSSES[row.get("losses_equal")]
            spread = row.get("ms_quartiles")
            lines.append(f"  {name:26} {row['ms_per_iter']:8.1f} ms  x{row.get('x_no_offload', 0):.3f}  "
                         + (f"({row['x_floor']:.3f}x its floor)  " if row.get("x_floor") else "")
                         + (f"(quartiles {spread[0]:.0f}-{spread[1]:.0f}){rounds_text(row)}  " if spread else "")
                         + f"peak reserved {row.get('peak_reserved_GiB', 0):.2f} GiB  {equal}"
                         + retries_text(row)
                         + (f"  streamed in step {row['streamed_in_step_GiB']:.2f} GiB"
                            if row.get("streamed_in_step_GiB") else "")
                         + ("  (from its uncapped run)" if "derived" in row else "") + pace_text(row))  # fmt: skip
    marked = {f"cap {plan['percent']}%: {name}": row["phases_ms"] for plan in result["caps"]
              for name, row in plan["rows"].items() if row.get("phases_ms") and "derived" not in row}  # fmt: skip
    if marked and result["no_offload"].get("phases_ms"):
        lines += ["", "phases (benchmarks/phases.py): no offload's GPU ms, the others' difference to it; host ms in ()"]
        rows = {NO_OFFLOAD: result["no_offload"]["phases_ms"], **marked}
        lines.append(phase_lines.table(rows, base=NO_OFFLOAD).rstrip())
    return "\n".join(lines) + "\n"
