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
