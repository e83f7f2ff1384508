"""The nightly memory comparison (benchmarks/compare_memory.py) on recorded logs: no GPU, no Megatron run.

The logs under tests/data/memory_logs/ are small synthetic ones in Megatron-LM 0.19.2's formats (6
iterations of configs/nightly_memory.yaml on one GPU); snapshots are built here, tiny, in the format of
``torch.cuda.memory._snapshot()``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compare_memory, memory_runs, nightly_runs
from benchmarks.memory_checks import ThresholdsError, load_thresholds
from benchmarks.memory_report import expected_state_bytes, last_error_line, parse_log
from benchmarks.memory_summary import summarize

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "memory_logs"

PARAMETERS = 732_257_280  # what the fixture logs print for configs/nightly_memory.yaml


RUNS = ("baseline", "step", "capped-no-offload", "capped-default")


def logs_dir(tmp_path: Path, cpu_offload: bool = True, **replace: tuple[str, str]) -> Path:
    """A --from-logs folder holding the fixture logs; ``replace``: run name (``_`` for ``-``) -> (old, new)
    text to change in that run's log."""
    folder = tmp_path / "logs"
    folder.mkdir()
    for name in RUNS + (("cpu-offload",) if cpu_offload else ()):
        shutil.copy(DATA / f"{name}.log", folder / f"{name}.log")
    for key, (old, new) in replace.items():
        log = folder / f"{key.replace('_', '-')}.log"
        text = log.read_text()
        assert old in text, f"{old!r} not in {log.name}"
        log.write_text(text.replace(old, new))
    return folder


def verdict(folder: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, dict]:
    """Run the tool in --from-logs mode; its exit code, printed output and report.json."""
    code = compare_memory.main(["--from-logs", str(folder), *extra])
    return code, capsys.readouterr().out, json.loads((folder / "report.json").read_text())


def results(report: dict) -> dict[str, bool]:
    return {check["name"]: check["passed"] for check in report["checks"]}


CHECKS = [
    "step_peak_saving", "capped_no_offload_out_of_memory", "capped_default_fits", "step_time_step",
    "step_time_capped_default", "losses_equal_step", "losses_equal_capped_default",
]  # fmt: skip


def failing(report: dict) -> list[str]:
    return [name for name, passed in results(report).items() if not passed]


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


@pytest.mark.parametrize(
    "replace, fails",
    [
        # step's peak only 4.5 GiB lower: the state, or half of it, stayed on the GPU at the peak
        ({"step": ("max allocated: 29832.70", "max allocated: 33602.45")}, ["step_peak_saving"]),
        # the capped default held more than the cap
        ({"capped_default": ("max reserved: 35328.00", "max reserved: 36352.00")}, ["capped_default_fits"]),
        # one loss one digit off in the step row
        ({"step": ("lm loss: 9.887412E+00", "lm loss: 9.887413E+00")}, ["losses_equal_step"]),
        # the capped default at 750 ms: over its floor of 631 ms x 1.1
        ({"capped_default": ("iteration (ms): 6", "iteration (ms): 7")}, ["step_time_capped_default"]),
    ],
)  # fmt: skip
def test_each_check_fails_on_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replace: dict, fails: list[str]
) -> None:
    code, out, report = verdict(logs_dir(tmp_path, **replace), capsys)
    assert code == 1, out
    assert failing(report) == fails
    assert f"FAIL  {fails[0]}" in out and f"OVERALL: FAIL ({fails[0]})" in out


def test_step_time_over_the_floor_fails_and_a_slower_link_raises_the_floor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The threshold follows the link the same run measured: 1030 ms fails at 159 ms a copy each way (floor
    867 ms, threshold 954) and passes where they took 318 ms (floor 1186 ms): the time is held to the link,
    not to a past run."""
    slow = {"step": ("elapsed time per iteration (ms): 88", "elapsed time per iteration (ms): 103")}
    code, out, report = verdict(logs_dir(tmp_path, **slow), capsys)
    assert code == 1 and failing(report) == ["step_time_step"]
    assert report["measured"]["floors"]["step"]["floor_ms"] == pytest.approx(867.5, abs=1)
    (tmp_path / "slow_link").mkdir()
    folder = logs_dir(tmp_path / "slow_link", **slow)
    log = folder / "step.log"
    log.write_text(
        re.sub(r"copy out/in \(ms\): 1[56]\d\.\d/1[56]\d\.\d", "copy out/in (ms): 318.0/318.0", log.read_text())
    )
    code, out, report = verdict(folder, capsys)
    assert code == 0, out
    assert report["measured"]["floors"]["step"]["floor_ms"] == pytest.approx(600.15 + 318 - 50.01 + 318, abs=0.1)


def test_no_offload_that_fits_under_the_cap_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cap no offload fits under shows nothing: the check says the cap forced nothing off the GPU."""
    folder = logs_dir(tmp_path)
    shutil.copy(DATA / "baseline.log", folder / "capped-no-offload.log")
    code, out, report = verdict(folder, capsys)
    assert code == 1 and failing(report) == ["capped_no_offload_out_of_memory"]
    check = report["checks"][1]
    assert check["measured"] == "ok" and "the cap forces nothing off the GPU" in check["detail"]


def test_a_capped_default_out_of_memory_fails_its_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = logs_dir(tmp_path)
    shutil.copy(DATA / "capped-no-offload.log", folder / "capped-default.log")
    code, out, report = verdict(folder, capsys)
    assert code == 1
    assert failing(report) == ["capped_default_fits", "step_time_capped_default", "losses_equal_capped_default"]
    assert report["checks"][2]["measured"] == "failed"


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


def test_run_mode_streams_each_run_into_its_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run path, with each torchrun replaced by a process that prints a recorded log."""

    def replay(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
        code = 1 if name in ("cpu-offload", "capped-no-offload") else 0
        commands[name] = memory_runs.flags_of(name, args.cap_gib)
        script = f"import sys; sys.stdout.write(open({str(DATA / f'{name}.log')!r}).read()); sys.exit({code})"
        return [sys.executable, "-c", script]

    commands: dict[str, list[str]] = {}
    monkeypatch.setattr(memory_runs, "run_command", replay)
    out_dir = tmp_path / "out"
    code = compare_memory.main(["--config", "configs/nightly_memory.yaml", "--out", str(out_dir), "--", "--seed", "7"])
    printed = capsys.readouterr()
    assert code == 0, printed.out
    assert "[step] iteration 6/6 (883.4 ms)" in printed.err  # plain progress lines off a terminal
    info = json.loads((out_dir / "run_info.json").read_text())
    assert {name: run["returncode"] for name, run in info["runs"].items()} == {
        "baseline": 0, "step": 0, "capped-no-offload": 1, "capped-default": 0, "cpu-offload": 1,
    }  # fmt: skip
    # the cap from the baseline's log: 39.18 GiB reserved less half of the 8.18 GiB state, rounded down
    assert info["cap_gib"] == 35.08
    assert commands["capped-no-offload"] == ["--offload-gpu-memory-cap-gib", "35.08"]
    assert commands["capped-default"] == ["--offload-optimizer-states", "--offload-gpu-memory-cap-gib", "35.08"]
    assert info["extra_args"] == ["--seed", "7"]
    assert "iteration        6/       6" in (out_dir / "step.log").read_text()
    report = json.loads((out_dir / "report.json").read_text())
    assert report["runs"]["cpu-offload"]["summary"]["detail"].startswith("exit 1: ModuleNotFoundError")
    assert report["verdict"] == "PASS"


def test_without_a_cap_from_the_baseline_the_capped_rows_do_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A baseline log without memory lines gives no cap: the capped rows are skipped and their checks fail."""
    empty = tmp_path / "empty.log"
    empty.write_text("no memory lines\n")

    def replay(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
        source = empty if name == "baseline" else DATA / f"{name}.log"
        return [sys.executable, "-c", f"import sys; sys.stdout.write(open({str(source)!r}).read())"]

    monkeypatch.setattr(memory_runs, "run_command", replay)
    out_dir = tmp_path / "out"
    code = compare_memory.main(["--config", "configs/nightly_memory.yaml", "--out", str(out_dir), "--skip-cpu-offload"])
    assert code == 2  # the baseline gave no iterations either: no verdict
    info = json.loads((out_dir / "run_info.json").read_text())
    assert info["runs"]["capped-default"]["skipped"].startswith("no cap: the baseline log gives no peak reserved")
    assert list(info["timeline_runs"]) == ["baseline", "step"]  # no cap, no capped run, no timeline run of it
    report = json.loads((out_dir / "report.json").read_text())
    assert any(note.startswith("capped-no-offload did not run: no cap") for note in report["notes"])


def test_run_command_and_environment_of_a_run(tmp_path: Path) -> None:
    args = argparse.Namespace(config=Path("configs/nightly_memory.yaml"), out=tmp_path, gpus=2, iters=5, cap_gib=35.08)
    capped = memory_runs.run_command("capped-default", args, [])
    assert capped[-3:] == ["--offload-optimizer-states", "--offload-gpu-memory-cap-gib", "35.08"]
    for name in memory_runs.RUN_FLAGS:  # the judged rows: no allocator history, no snapshot dump
        row = memory_runs.run_command(name, args, [])
        assert "--record-memory-history" not in row and "--memory-snapshot-path" not in row, name
    command = memory_runs.run_command("cpu-offload", args, ["--seed", "7"])
    assert command[1:7] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "scripts/pretrain_gpt.py",
    ]
    text = " ".join(command)
    assert "--log-interval 1 --log-memory-interval 1 --train-iters 5 --optimizer-cpu-offload" in text
    assert text.endswith("--optimizer-cpu-offload --use-precision-aware-optimizer --seed 7")


def test_a_hung_run_is_killed_after_the_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(out=tmp_path, gpus=1, timeout_min=1 / 60)
    command = [sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"]
    assert nightly_runs.run_one("baseline", command, args, nightly_runs.RunProgress(["baseline"])) == -9
    log = (tmp_path / "baseline.log").read_text()
    assert "starting" in log and "still running after" in log
    assert "[baseline] exit -9" in capsys.readouterr().err


def test_rich_progress_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("rich", reason="progress bars need rich; without it the tool prints plain lines")
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then takes stderr for a terminal
    with nightly_runs.RunProgress(["baseline", "step"]) as progress:
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
    thresholds.write_text(text.replace("max_time_over_floor:", "max_time_over_flor:"))
    command = [sys.executable, "-m", "benchmarks.compare_memory", "--from-logs", str(logs_dir(tmp_path))]
    result = subprocess.run([*command, "--thresholds", str(thresholds)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown keys ['max_time_over_flor'], missing keys ['max_time_over_floor']" in result.stderr


@pytest.mark.parametrize(
    "text, message",
    [
        ("- 1\n", "expected a mapping"),
        ("min_step_peak_saving_of_state: 0.9\n", "missing keys"),
        ("min_step_peak_saving_of_state: yes\nmax_time_over_floor: 0.1\nlosses_equal: true\n",
         "min_step_peak_saving_of_state must be a number"),
        ("min_step_peak_saving_of_state: 0.9\nmax_time_over_floor: 0.1\nlosses_equal: 1\n",
         "losses_equal must be true or false"),
        ("min_step_peak_saving_of_state: 0.9\nmax_time_over_floor: 0.1\nlosses_equal: true\nthresholds_reached: 1\n",
         "unknown keys \\['thresholds_reached'\\]"),
    ],
)  # fmt: skip
def test_thresholds_are_strict(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "thresholds.yaml"
    path.write_text(text)
    with pytest.raises(ThresholdsError, match=message):
        load_thresholds(path)


def test_shipped_thresholds_load() -> None:
    limits = load_thresholds(ROOT / "configs" / "nightly_thresholds.yaml")
    assert limits.min_step_peak_saving_of_state == 0.9 and limits.losses_equal is True
    assert 0 < limits.max_time_over_floor < 0.5


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


def test_the_commit_passed_in_names_the_runs_over_whatever_git_the_tree_carries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEGATRON_OFFLOAD_COMMIT", "abc1234")
    assert nightly_runs.environment()["commit"] == "abc1234"
    monkeypatch.delenv("MEGATRON_OFFLOAD_COMMIT")
    assert nightly_runs.environment()["commit"] != "abc1234"
