"""The nightly memory comparison's log reader and run summaries (benchmarks/memory_report.py,
memory_summary.py): out-of-memory and early-stop lines, the expected optimizer state from the parameter
counts, the highest rank's memory lines, and the last error line under torchrun's noise."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.memory_report import expected_state_bytes, last_error_line, parse_log
from benchmarks.memory_summary import summarize
from tests.compare_memory_helpers import DATA, logs_dir, verdict


def test_the_launchers_one_line_names_why_no_offload_ran_out_of_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = (
        "megatron-offload: out of GPU memory under --offload-gpu-memory-cap-gib 35.08: asked for 256.00 MiB with "
        "34.90 GiB reserved at the peak. To move more off the GPU, add: --offload-optimizer-states"
    )
    folder = logs_dir(tmp_path, capped_no_offload=("[rank0]: torch.OutOfMemoryError: CUDA out of memory.", line))
    code, out, report = verdict(folder, capsys)
    summary = report["runs"]["capped-no-offload"]["summary"]
    assert code == 0 and summary["status"] == "out of memory"
    assert summary["detail"] == line.split(". ")[0]  # not torchrun's closing banner


def test_a_step_run_that_stopped_early_exits_2_without_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = logs_dir(tmp_path)
    step = folder / "step.log"
    lines = step.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if "iteration        4/" in line)
    step.write_text("\n".join(lines[:end] + ["[rank0]: torch.OutOfMemoryError: CUDA out of memory."]))
    code, out, report = verdict(folder, capsys)
    assert code == 2
    assert report["verdict"] == "ERROR" and report["checks"] == []
    assert report["runs"]["step"]["summary"]["status"] == "failed"
    assert "stopped at iteration 3 of 6" in out


def test_expected_state_with_tensor_and_data_parallelism() -> None:
    """Parameters printed per (tensor, pipeline) rank add up, then shard over the world size."""
    log = parse_log(
        "------------------------ arguments ------------------------\n"
        "  data_parallel_size .............................. 2\n"
        "  tensor_model_parallel_size ...................... 2\n"
        "  world_size ...................................... 4\n"
        "-------------------- end of arguments ---------------------\n"
        " > number of parameters on (tensor, gtp_remat, pipeline) model parallel rank (0, 0, 0): 370000000\n"
        " > number of parameters on (tensor, gtp_remat, pipeline) model parallel rank (1, 0, 0): 370000000\n"
    )
    assert expected_state_bytes(log, master_weights=True)[0] == 12 * 740_000_000 // 4
    assert expected_state_bytes(log, master_weights=False)[0] == 8 * 740_000_000 // 4
    assert expected_state_bytes(parse_log(""), master_weights=True)[0] is None


def test_memory_lines_of_the_highest_rank_are_used() -> None:
    lines = [
        " iteration        3/       3 | elapsed time per iteration (ms): 57.4 | lm loss: 1.0E+01 |",
        "[Rank 0] (after 3 iterations) memory (MB) | allocated: 100.00 | max allocated: 200.00 | reserved: 300.00 | "
        "max reserved: 400.00",
        "[Rank 1] (after 3 iterations) memory (MB) | allocated: 110.00 | max allocated: 210.00 | reserved: 310.00 | "
        "max reserved: 410.00",
    ]
    summary = summarize(parse_log("\n".join(lines)))
    assert summary.status == "ok" and summary.memory_rank == 1
    assert summary.allocated_gib == pytest.approx(110 / 1024) and summary.max_reserved_gib == pytest.approx(410 / 1024)


def test_last_error_line_skips_torchrun_noise() -> None:
    assert last_error_line((DATA / "cpu-offload.log").read_text()) == (
        "ModuleNotFoundError: No module named 'transformer_engine'"
    )
    assert last_error_line("starting\nKilled\n") == "Killed"
    assert last_error_line("[rank1]: AssertionError\n=====\n") == "AssertionError"
