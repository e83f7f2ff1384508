"""The nightly memory comparison's runs (benchmarks/memory_runs.py, nightly_runs.py): the run mode with each
torchrun replaced by a replayed log, each run's command line, the timeout, progress, the tool's usage errors,
and the commit the runs are recorded under."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from benchmarks import compare_memory, host_pace, memory_runs, nightly_runs
from tests.compare_memory_helpers import DATA


def test_run_mode_streams_each_run_into_its_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run path, with each torchrun replaced by a process that prints a recorded log."""

    def replay(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
        code = 1 if name in ("cpu-offload", "capped-no-offload") else 0
        commands[name] = memory_runs.flags_of(name, args.cap_gib)
        script = f"import sys; sys.stdout.write(open({str(DATA / f'{name}.log')!r}).read()); sys.exit({code})"
        if name == "baseline":  # the first row waits for the night's sampler of the host's pace to write a line
            pace = str(out_dir / "host-pace.txt")
            script = (f"import os, time\nstart = time.time()\nwhile time.time() - start < 15 and not "
                      f"(os.path.exists({pace!r}) and open({pace!r}).read().count(chr(10))): time.sleep(0.05)\n"
                      + script)  # fmt: skip
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
        "baseline": 0, "step": 0, "capped-no-offload": 1, "capped-default": 0, "baseline-again": 0, "cpu-offload": 1,
    }  # fmt: skip
    assert list(info["runs"])[:5] == ["baseline", "step", "capped-no-offload", "capped-default", "baseline-again"]
    # the cap from the baseline's log: 39.18 GiB reserved less half of the 8.18 GiB state, rounded down
    assert info["cap_gib"] == 35.08
    assert commands["capped-no-offload"] == ["--offload-gpu-memory-cap-gib", "35.08"]
    assert commands["capped-default"] == ["--offload-optimizer-states", "--offload-gpu-memory-cap-gib", "35.08"]
    assert info["extra_args"] == ["--seed", "7"]
    assert "iteration        6/       6" in (out_dir / "step.log").read_text()
    report = json.loads((out_dir / "report.json").read_text())
    assert report["runs"]["cpu-offload"]["summary"]["detail"].startswith("exit 1: ModuleNotFoundError")
    assert report["verdict"] == "PASS"
    assert host_pace.read_samples(out_dir / "host-pace.txt")  # sampled beside the rows


def test_a_night_cut_short_in_the_timeline_reruns_keeps_its_verdict_and_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judged rows' report and run record are written before the first timeline rerun starts."""

    def replay(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
        code = 1 if name == "capped-no-offload" else 0
        script = f"import sys; sys.stdout.write(open({str(DATA / f'{name}.log')!r}).read()); sys.exit({code})"
        return [sys.executable, "-c", script]

    def cut_short(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
        raise KeyboardInterrupt  # the job's wall limit, as the first timeline rerun would start

    monkeypatch.setattr(memory_runs, "run_command", replay)
    monkeypatch.setattr(memory_runs, "timeline_command", cut_short)
    out_dir = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        compare_memory.main(["--config", "configs/nightly_memory.yaml", "--out", str(out_dir), "--skip-cpu-offload"])
    report = json.loads((out_dir / "report.json").read_text())
    assert report["verdict"] == "PASS"
    assert "PASS" in (out_dir / "report.md").read_text()
    info = json.loads((out_dir / "run_info.json").read_text())
    assert info["environment"] == report["environment"] and info["timeline_runs"] == {}
    assert {name: run["returncode"] for name, run in info["runs"].items()} == {
        "baseline": 0, "step": 0, "capped-no-offload": 1, "capped-default": 0, "baseline-again": 0,
    }  # fmt: skip


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


def test_the_commit_passed_in_names_the_runs_over_whatever_git_the_tree_carries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEGATRON_OFFLOAD_COMMIT", "abc1234")
    assert nightly_runs.environment()["commit"] == "abc1234"
    monkeypatch.delenv("MEGATRON_OFFLOAD_COMMIT")
    assert nightly_runs.environment()["commit"] != "abc1234"
