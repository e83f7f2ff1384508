"""Benchmarks and the nightly memory comparison, run from the repository root as ``python -m benchmarks.NAME``."""

__all__ = [
    "compare_memory",
    "copy_order_probe",
    "gpt_training",
    "megatron_side_by_side",
    "memory_checks",
    "memory_markdown",
    "memory_plots",
    "memory_report",
    "memory_speed_curve",
    "nightly_runs",
    "offload_bandwidth",
    "run_logs",
    "sleep_wake",
    "summarize",
    "trace_summary",
    "weight_streaming",
]
