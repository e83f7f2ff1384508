"""benchmarks/megatron_side_by_side.py's ``--rounds`` without a GPU (the torchrun jobs stood in for), and every
side-by-side command line the README and docs show."""

from __future__ import annotations

import json
import re
import shlex
import statistics
import sys
from pathlib import Path

import pytest

from benchmarks import megatron_side_by_side as side
from benchmarks.side_by_side_args import parse_args
from tests.side_by_side_helpers import fake_run, run_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def runs_can_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs are stood in for: the harness's check that a job could start (CUDA, megatron.training) passes."""
    monkeypatch.setattr(side, "preflight", lambda argv: None)


def test_rounds_run_every_row_that_ran_again_in_turn_and_pool_its_iterations(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    """Two rounds: each row that ran in the first runs once more, in reverse order, its log named for the
    round; a row that failed (the capped no offload, meant to) is not run again. Each row's ms/iter is the
    median of its counted iterations from both rounds, each round's own beside it, its peak the higher."""
    fails = {"log1-cap-90-no-offload", "log1-cap-50-no-offload"}
    first = fake_run(fails)

    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        figures = first(name, argv, gpus, out, env_extra)
        if "error" in figures:
            return figures
        again = "-r2-" in name
        base = 200.0 if again else 100.0  # the machine ran slower in the second round
        # Iterations 1-2 are slow and never counted (megatron_job.steady counts from iteration 3).
        by_iteration = {1: 5000.0, 2: 900.0, 3: base, 4: base + 10, 5: base + 20}
        return figures | {"step_ms": base + 10, "step_ms_by_iteration": by_iteration,
                          "peak_reserved_GiB": 6.0 if again else 5.0}  # fmt: skip

    args = ["--upstream-megatron-lm", str(upstream), "--out", str(tmp_path), "--log-intervals", "1", "--rounds", "2"]
    code, calls = run_main(monkeypatch, args, run)
    names = [name for name, _, _ in calls]
    first_round = [name for name in names if "-r2-" not in name]
    assert code == 0
    again = [name.replace("-r2-", "-") for name in names if "-r2-" in name]
    assert again == [n for n in first_round if n not in fails][::-1]
    for name, argv, env in calls:
        if "-r2-" in name:  # the same command and environment as that row's first round
            assert (argv, env) == next((a, e) for n, a, e in calls if n == name.replace("-r2-", "-"))
    results = json.loads((tmp_path / "side_by_side.json").read_text())["runs"]["log-interval 1"]
    step = results["prefetch step"]
    assert step["step_ms_per_round"] == [110.0, 210.0]
    assert step["step_ms"] == pytest.approx(statistics.median([100, 110, 120, 200, 210, 220]))
    assert step["peak_reserved_GiB"] == 6.0 and step["rounds"] == 2
    assert step["losses_equal"] is True and step["x_base"] == pytest.approx(1.0)
    assert "error" in results["cap 90%: no offload"]
    assert "(rounds 110, 210)" in (tmp_path / "table.txt").read_text()


def test_a_row_whose_losses_change_between_rounds_differs_from_its_base(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fails = {"log1-cap-90-no-offload", "log1-cap-50-no-offload"}
    first = fake_run(fails)

    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        figures = first(name, argv, gpus, out, env_extra)
        if name == "log1-r2-prefetch-step":
            figures["losses"] = {5: 1.0000001}  # the same flags, another loss: not deterministic
        return figures

    args = ["--out", str(tmp_path), "--log-intervals", "1", "--rounds", "2"]
    code, _ = run_main(monkeypatch, args, run)
    results = json.loads((tmp_path / "side_by_side.json").read_text())["runs"]["log-interval 1"]
    assert code == 1
    assert results["prefetch step"]["losses_equal"] is False
    assert results["full offload (auto)"]["losses_equal"] is True


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every side-by-side command line the README and docs show: ``python -m benchmarks.megatron_side_by_side``
    (continued lines joined, optional ``[...]`` parts left out) and what ``SWEEP_ARGS``/``SIDE_ARGS`` hand it
    through scripts/device_check.sh; as (where, argv)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            while line.endswith("\\") and number < len(lines):  # continued on the next line
                line = line[:-1] + lines[number]
                lines[number] = ""
            where, line = f"{path.name}:{number}", line.split(" # ")[0]
            if line.lstrip().startswith("python -m benchmarks.megatron_side_by_side"):
                words = shlex.split(re.sub(r"\[[^\]]*\]", "", line))
                found.append((where, words[3:]))
            for variable, head in (("SWEEP_ARGS", ["--sweep"]), ("SIDE_ARGS", [])):
                for value in re.findall(rf'{variable}="([^"]*)"', line):
                    found.append((where, [*head, *shlex.split(value)]))
    return found


def test_every_documented_command_line_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    commands = documented_commands()
    assert len(commands) >= 5  # the docs show the matrix, the sweep and device_check's variables
    for where, argv in commands:
        monkeypatch.setattr(sys, "argv", ["megatron_side_by_side.py", *argv])
        try:
            parse_args("side by side")
        except SystemExit as stop:
            pytest.fail(f"{where}: {' '.join(argv)} does not parse (exit {stop.code})")


def test_a_run_counts_seven_lines_at_interval_5_unless_told_how_many_iterations(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    """At --log-interval 5 every run of the matrix, ours and upstream's, has 40 iterations: its lines from
    iteration 10 on are seven, so one line holding a garbage-collection pause does not decide the row; at 1,
    15. --train-iters sets every run's count."""

    def iterations(argv: list[str]) -> int:
        return int(argv[argv.index("--train-iters") + 1])

    def interval(argv: list[str]) -> int:
        return int(argv[argv.index("--log-interval") + 1])

    fails = {"log1-cap-90-no-offload", "log1-cap-50-no-offload", "log5-cap-90-no-offload", "log5-cap-50-no-offload"}
    args = ["--upstream-megatron-lm", str(upstream), "--log-intervals", "5", "1"]
    code, calls = run_main(monkeypatch, [*args, "--out", str(tmp_path / "a")], fake_run(fails))
    assert code == 0 and {interval(a) for _, a, _ in calls} == {1, 5}
    assert all(iterations(a) == {5: 40, 1: 15}[interval(a)] for _, a, _ in calls)
    assert any(env is not None and interval(a) == 5 for _, a, env in calls)  # upstream's rows count alike
    code, calls = run_main(monkeypatch, [*args, "--train-iters", "9", "--out", str(tmp_path / "b")], fake_run(fails))
    assert code == 0 and calls and all(iterations(a) == 9 for _, a, _ in calls)
