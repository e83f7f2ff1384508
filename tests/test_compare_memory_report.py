"""The nightly memory comparison's report (report.json, report.md and its notes) on recorded logs: the passing
logs' verdict, measured floors and table rows, a missing reference run, and no plot without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.compare_memory_helpers import RUNS, logs_dir, results, verdict

PARAMETERS = 732_257_280  # what the fixture logs print for configs/nightly_memory.yaml


CHECKS = [
    "step_peak_saving", "capped_no_offload_out_of_memory", "capped_default_fits", "step_time_step",
    "step_time_capped_default", "losses_equal_step", "losses_equal_capped_default",
]  # fmt: skip


def test_passing_logs_exit_0_and_write_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fixture logs: step saves the whole state at the peak, no offload runs out of memory under the cap
    of 39.18 GiB reserved less half of 8.18 GiB, the default fits under it, every row within its floor."""
    folder = logs_dir(tmp_path)
    code, out, report = verdict(folder, capsys)
    assert code == 0, out
    assert "OVERALL: PASS" in out
    assert report["verdict"] == "PASS" and list(results(report)) == CHECKS
    assert report["state_bytes"] == 12 * PARAMETERS
    assert report["measured"]["cap_gib"] == 35.08
    step = report["measured"]["floors"]["step"]
    # 8.18 GiB out in 159 ms (55.3 GB/s), less a forward: a third of a quarter of no offload's 600.15 ms;
    # back in 158 ms, hidden behind nothing (step brings the state back in the step)
    assert step["link_out_gbps"] == pytest.approx(8.18 * 2**30 / 0.159 / 1e9, rel=0.002)
    assert step["forward_ms"] == pytest.approx(600.15 / 4 / 3) and step["return_hidden_ms"] == 0
    assert step["floor_ms"] == pytest.approx(600.15 + 159 - 600.15 / 12 + 158, abs=1)
    capped = report["measured"]["floors"]["capped-default"]  # its 80.5 ms return hides behind the last backward
    assert capped["return_hidden_ms"] == pytest.approx(2 * 600.15 / 12)
    assert capped["floor_ms"] == pytest.approx(600.15 + 81 - 600.15 / 12, abs=0.5)
    assert step["threshold_ms"] == pytest.approx(step["floor_ms"] * 1.1)
    runs = report["runs"]
    assert runs["step"]["flags"] == ["--offload-optimizer-states", "--offload-prefetch", "step"]
    assert runs["capped-default"]["flags"] == ["--offload-optimizer-states", "--offload-gpu-memory-cap-gib", "35.08"]
    assert runs["capped-no-offload"]["summary"]["status"] == "out of memory"
    assert runs["capped-no-offload"]["summary"]["detail"] == "torch.OutOfMemoryError: CUDA out of memory"
    cpu = runs["cpu-offload"]["summary"]
    assert cpu["status"] == "not available" and "No module named 'transformer_engine'" in cpu["detail"]
    markdown = (folder / "report.md").read_text()
    # the median of iterations 3-6 (881.6, 885.2, 889.9, 883.4 ms) and their quartiles, how far they spread
    assert (
        "| step | `--offload-optimizer-states --offload-prefetch step` | ok | 884.3 (882-889) | 1.473 | 867."
        in markdown
    )
    assert runs["step"]["summary"]["quartile_step_ms"] == pytest.approx([882.05, 888.725])
    step_time = next(check for check in report["checks"] if check["name"] == "step_time_step")
    assert step_time["detail"].endswith(
        "; quartiles 882-889 ms, no offload's "
        + "{:.0f}-{:.0f}".format(*runs["baseline"]["summary"]["quartile_step_ms"])
    )
    assert "| capped_default_fits | ran through, peak reserved <= 35.08 GiB | 34.50 GiB | PASS |" in markdown
    assert "12 bytes x 732,257,280 parameters per model-parallel rank" in markdown


def test_the_reference_run_may_be_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, report = verdict(logs_dir(tmp_path, cpu_offload=False), capsys)
    assert code == 0, out
    assert list(report["runs"]) == list(RUNS)


def test_without_matplotlib_the_report_says_why_there_is_no_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    folder = logs_dir(tmp_path)
    code, out, report = verdict(folder, capsys)
    assert code == 0, out
    assert "no plots: matplotlib is not installed (pip install matplotlib)" in report["notes"]
    assert not (folder / "peak_memory.png").exists()


def test_each_row_says_the_hosts_pace_over_its_steady_iterations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Samples of the host's pace beside the runs (host-pace.txt): the baseline's steady iterations (00:38:36-38 by
    Megatron's stamps) fell in fast seconds, step's (00:38:37-40) half in a slow one."""
    from datetime import datetime

    folder = logs_dir(tmp_path)
    at = datetime(2026, 11, 22, 0, 38, 0).timestamp()
    samples = [(at - 60 + s, 1.0) for s in range(60)] + [(at + 36.5, 1.0), (at + 37.5, 1.0), (at + 39.5, 2.0)]
    (folder / "host-pace.txt").write_text("".join(f"{t:.3f} {ms:.4f}\n" for t, ms in samples))
    code, out, report = verdict(folder, capsys)
    assert code == 0, out
    runs = report["runs"]
    assert runs["baseline"]["summary"]["host_pace_ms"] == 1.0 and runs["baseline"]["summary"]["host_slow_share"] == 0
    assert runs["step"]["summary"]["host_pace_ms"] == 1.5 and runs["step"]["summary"]["host_slow_share"] == 0.5
    assert runs["capped-no-offload"]["summary"]["host_pace_ms"] is None  # it never reached a steady iteration
    markdown = (folder / "report.md").read_text()
    step_row = next(line for line in markdown.splitlines() if line.startswith("| step |"))
    assert "| 1.50 (50%) |" in step_row
