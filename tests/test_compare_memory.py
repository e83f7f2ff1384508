"""The nightly memory comparison (benchmarks/compare_memory.py) on recorded logs: no GPU, no Megatron run.

The logs under tests/data/memory_logs/ are small synthetic ones in Megatron-LM 0.19.2's formats (6
iterations of configs/nightly_memory.yaml on one GPU); snapshots are built here, tiny, in the format of
``torch.cuda.memory._snapshot()``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compare_memory
from benchmarks.memory_plots import allocated_timeline
from benchmarks.memory_report import (
    ThresholdsError,
    expected_state_bytes,
    last_error_line,
    load_thresholds,
    parse_log,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "memory_logs"

PARAMETERS = 732_257_280  # what the fixture logs print for configs/nightly_memory.yaml


def logs_dir(tmp_path: Path, offload: str = "offload.log", cpu_offload: bool = True) -> Path:
    """A --from-logs folder holding the fixture logs under the names the tool reads."""
    folder = tmp_path / "logs"
    folder.mkdir()
    shutil.copy(DATA / "baseline.log", folder / "baseline.log")
    shutil.copy(DATA / offload, folder / "offload.log")
    if cpu_offload:
        shutil.copy(DATA / "cpu-offload.log", folder / "cpu-offload.log")
    return folder


def verdict(folder: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, dict]:
    """Run the tool in --from-logs mode; its exit code, printed output and report.json."""
    code = compare_memory.main(["--from-logs", str(folder), *extra])
    return code, capsys.readouterr().out, json.loads((folder / "report.json").read_text())


def test_passing_logs_exit_0_and_write_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = logs_dir(tmp_path)
    code, out, report = verdict(folder, capsys)
    assert code == 0, out
    assert "OVERALL: PASS" in out
    assert report["verdict"] == "PASS" and all(check["passed"] for check in report["checks"])
    assert [check["name"] for check in report["checks"]] == [
        "min_saving_fraction", "min_peak_saving_gib", "max_step_time_overhead", "losses_equal",
    ]  # fmt: skip
    assert report["saving"]["expected_bytes"] == 12 * PARAMETERS
    assert report["saving"]["saving_fraction"] == pytest.approx(1.0, abs=0.01)
    assert report["saving"]["step_time_overhead"] == pytest.approx(732.5 / 600.15 - 1)
    offload = report["runs"]["offload"]
    assert offload["series"]["iteration"] == [1, 2, 3, 4, 5, 6]
    assert offload["series"]["exposed_ms"][1] == 139.8
    assert offload["summary"]["offloaded_gib"] == 8.18
    cpu = report["runs"]["cpu-offload"]["summary"]
    assert cpu["status"] == "not available" and "No module named 'transformer_engine'" in cpu["detail"]
    markdown = (folder / "report.md").read_text()
    assert "| offload | ok | 732.5 | +22.1% | 4.10 | 29.13 | 31.00 | 8.18 | 131.6 | 9.405518E+00 |" in markdown
    assert "not available: ModuleNotFoundError" in markdown
    assert "12 bytes x 732,257,280 parameters per model-parallel rank" in markdown
    assert "| max_step_time_overhead | <= +50% | +22.1% | PASS |" in markdown
    assert "no baseline.snapshot.pickle" in markdown  # the plot says which run it lacks


def test_half_the_saving_fails_min_saving_fraction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, report = verdict(logs_dir(tmp_path, offload="offload_half_saving.log"), capsys)
    assert code == 1
    assert "FAIL  min_saving_fraction" in out and "OVERALL: FAIL (min_saving_fraction)" in out
    assert {check["name"]: check["passed"] for check in report["checks"]} == {
        "min_saving_fraction": False, "min_peak_saving_gib": True, "max_step_time_overhead": True, "losses_equal": True,
    }  # fmt: skip
    assert report["saving"]["saving_fraction"] == pytest.approx(0.5, abs=0.01)


def test_differing_losses_fail_losses_equal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = logs_dir(tmp_path)
    offload = folder / "offload.log"
    offload.write_text(offload.read_text().replace("lm loss: 9.887412E+00", "lm loss: 9.887413E+00"))
    code, out, report = verdict(folder, capsys)
    assert code == 1
    assert "FAIL  losses_equal" in out and "OVERALL: FAIL (losses_equal)" in out
    assert "1 iterations differ, first 4" in report["checks"][-1]["detail"]


def test_a_run_that_stopped_early_exits_2_without_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = logs_dir(tmp_path)
    offload = folder / "offload.log"
    lines = offload.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if "iteration        4/" in line)
    offload.write_text("\n".join(lines[:end] + ["[rank0]: torch.OutOfMemoryError: CUDA out of memory."]))
    code, out, report = verdict(folder, capsys)
    assert code == 2
    assert report["verdict"] == "ERROR" and report["checks"] == []
    assert report["runs"]["offload"]["summary"]["status"] == "failed"
    assert "stopped at iteration 3 of 6" in out


def test_the_reference_run_may_be_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, report = verdict(logs_dir(tmp_path, cpu_offload=False), capsys)
    assert code == 0, out
    assert list(report["runs"]) == ["baseline", "offload"]


def test_run_mode_streams_each_run_into_its_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run path, with each torchrun replaced by a process that prints a recorded log."""

    def replay(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
        code = 1 if name == "cpu-offload" else 0
        script = f"import sys; sys.stdout.write(open({str(DATA / f'{name}.log')!r}).read()); sys.exit({code})"
        return [sys.executable, "-c", script]

    monkeypatch.setattr(compare_memory, "run_command", replay)
    out_dir = tmp_path / "out"
    code = compare_memory.main(["--config", "configs/nightly_memory.yaml", "--out", str(out_dir), "--", "--seed", "7"])
    printed = capsys.readouterr()
    assert code == 0, printed.out
    assert "[offload] iteration 6/6 (733.4 ms)" in printed.err  # plain progress lines off a terminal
    info = json.loads((out_dir / "run_info.json").read_text())
    assert {name: run["returncode"] for name, run in info["runs"].items()} == {
        "baseline": 0, "offload": 0, "cpu-offload": 1,
    }  # fmt: skip
    assert info["extra_args"] == ["--seed", "7"]
    assert "iteration        6/       6" in (out_dir / "offload.log").read_text()
    report = json.loads((out_dir / "report.json").read_text())
    assert report["runs"]["cpu-offload"]["summary"]["detail"].startswith("exit 1: ModuleNotFoundError")


def test_run_command_and_environment_of_a_run(tmp_path: Path) -> None:
    args = argparse.Namespace(config=Path("configs/nightly_memory.yaml"), out=tmp_path, gpus=2, iters=5)
    command = compare_memory.run_command("cpu-offload", args, ["--seed", "7"])
    assert command[1:7] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "scripts/pretrain_gpt.py",
    ]
    text = " ".join(command)
    assert "--log-interval 1 --log-memory-interval 1 --record-memory-history --memory-snapshot-path" in text
    assert f"{tmp_path.resolve()}/cpu-offload.snapshot.pickle --train-iters 5" in text
    assert text.endswith("--optimizer-cpu-offload --use-precision-aware-optimizer --seed 7")


def test_a_hung_run_is_killed_after_the_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(out=tmp_path, gpus=1, timeout_min=1 / 60)
    command = [sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"]
    assert compare_memory.run_one("baseline", command, args, compare_memory.RunProgress(["baseline"])) == -9
    log = (tmp_path / "baseline.log").read_text()
    assert "starting" in log and "still running after" in log
    assert "[baseline] exit -9" in capsys.readouterr().err


def test_rich_progress_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("rich", reason="progress bars need rich; without it the tool prints plain lines")
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then takes stderr for a terminal
    with compare_memory.RunProgress(["baseline", "offload"]) as progress:
        assert progress.bars is not None
        progress.update("baseline", 3, 20, "57.4")
        progress.finish("baseline", "done")
    assert progress.bars.tasks[0].completed == 3 and progress.bars.tasks[0].total == 20


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "configs/missing.yaml", "--out", "x"], "no such file"),
        (["--out", "x"], "--config and --out are needed"),
        (["--config", "configs/nightly_memory.yaml", "--out", "x", "--iters", "2"], "--iters > 2"),
        (["--from-logs", "no/such/folder"], "no such folder"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        compare_memory.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_thresholds_key_exits_2_from_the_command_line(tmp_path: Path) -> None:
    thresholds = tmp_path / "thresholds.yaml"
    text = (ROOT / "configs" / "nightly_thresholds.yaml").read_text()
    thresholds.write_text(text.replace("min_saving_fraction:", "min_savings_fraction:"))
    command = [sys.executable, "-m", "benchmarks.compare_memory", "--from-logs", str(logs_dir(tmp_path))]
    result = subprocess.run([*command, "--thresholds", str(thresholds)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown keys ['min_savings_fraction'], missing keys ['min_saving_fraction']" in result.stderr


@pytest.mark.parametrize(
    "text, message",
    [
        ("- 1\n", "expected a mapping"),
        ("min_saving_fraction: 0.9\n", "missing keys"),
        ("min_saving_fraction: yes\nmin_peak_saving_gib: 0\nmax_step_time_overhead: 0.5\nlosses_equal: true\n",
         "min_saving_fraction must be a number"),
        ("min_saving_fraction: 0.9\nmin_peak_saving_gib: 0\nmax_step_time_overhead: 0.5\nlosses_equal: 1\n",
         "losses_equal must be true or false"),
    ],
)  # fmt: skip
def test_thresholds_are_strict(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "thresholds.yaml"
    path.write_text(text)
    with pytest.raises(ThresholdsError, match=message):
        load_thresholds(path)


def test_shipped_thresholds_load() -> None:
    limits = load_thresholds(ROOT / "configs" / "nightly_thresholds.yaml")
    assert 0 < limits.min_saving_fraction <= 1 and limits.losses_equal is True


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


def snapshot(final: list[tuple[int, str]], trace: list[tuple[float, str, int]]) -> dict:
    """A memory snapshot: blocks (size, state) live at the end, and (time ms, action, size) trace events."""
    blocks = [{"size": size, "state": state, "address": 0} for size, state in final]
    events = [{"action": action, "size": size, "time_us": ms * 1000, "addr": 0} for ms, action, size in trace]
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [events]}


TRACE = [
    (0, "alloc", 5000),  # before the window
    (10, "free_requested", 5000),
    (10.5, "free_completed", 5000),
    (12, "segment_alloc", 2**21),
    (12, "alloc", 700),
    (15, "free_requested", 200),  # still read by a side stream at the end: awaiting free, not allocated
    (17, "alloc", 500),
]
FINAL = [(700, "active_allocated"), (500, "active_allocated"), (200, "active_awaiting_free"), (300, "inactive")]


def test_timeline_walks_the_trace_back_from_the_allocated_blocks() -> None:
    xs, ys = allocated_timeline(snapshot(FINAL, TRACE), window_ms=8)
    assert xs == [0, 1, 1.5, 3, 3, 6, 8]
    assert ys == [5200, 200, 200, 200, 900, 700, 1200]
    with pytest.raises(ValueError, match="no allocator trace"):
        allocated_timeline({"segments": [], "device_traces": [[]]}, window_ms=8)


def test_plots_from_logs_and_snapshots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (pip install matplotlib)")
    folder = logs_dir(tmp_path)
    (folder / "baseline.snapshot.pickle").write_bytes(pickle.dumps(snapshot(FINAL, TRACE)))
    code, out, report = verdict(folder, capsys)
    assert code == 0, out
    for name in ("peak_memory.png", "memory_timeline.png"):
        assert (folder / name).read_bytes().startswith(b"\x89PNG")
    assert any("leaves out offload: no offload.snapshot.pickle" in note for note in report["notes"])
    assert not any("leaves out baseline" in note for note in report["notes"])


def test_thresholds_reached_by_a_run_are_written_and_pass_that_run_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After one run the lead adopts DIR/thresholds_reached.yaml: a strict thresholds file, each figure of
    the run with its REACHED_* room, under which the same logs pass and half the saving fails."""
    folder = logs_dir(tmp_path)
    code, out, report = verdict(folder, capsys)
    assert code == 0 and "thresholds_reached.yaml" in out
    reached = folder / "thresholds_reached.yaml"
    limits = load_thresholds(reached)
    saving = report["saving"]
    assert limits.min_saving_fraction == pytest.approx(saving["saving_fraction"] - 0.05, abs=0.005)
    assert limits.min_peak_saving_gib == pytest.approx(saving["peak_saving_gib"] * 0.8, abs=0.005)
    assert limits.max_step_time_overhead == pytest.approx(saving["step_time_overhead"] + 0.10, abs=0.005)
    assert limits.losses_equal is True
    again, out, _ = verdict(folder, capsys, "--thresholds", str(reached))
    assert again == 0, out
    (tmp_path / "half").mkdir()
    half = logs_dir(tmp_path / "half", offload="offload_half_saving.log")
    code, out, _ = verdict(half, capsys, "--thresholds", str(reached))
    assert code == 1 and "FAIL  min_saving_fraction" in out
