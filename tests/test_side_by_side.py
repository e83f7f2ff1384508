"""benchmarks/megatron_side_by_side.py without a GPU: its exit status, upstream's rows (its own script,
its own base, its flags and environment) and the profiled runs with their trace comparison, with the
torchrun jobs stood in for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from benchmarks import megatron_side_by_side as side
from benchmarks import side_by_side_profile as profile
from benchmarks import side_by_side_rows as rows
from benchmarks import side_by_side_upstream as side_upstream
from tests.side_by_side_helpers import fake_run, run_main

ROOT = Path(__file__).resolve().parents[1]

UPSTREAM_ROWS = [name for name, _ in rows.UPSTREAM]


@pytest.fixture(autouse=True)
def runs_can_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs are stood in for: the harness's check that a job could start (CUDA, megatron.training) passes."""
    monkeypatch.setattr(side, "preflight", lambda argv: None)


@pytest.mark.parametrize(
    ("failing", "status"),
    [
        (set(), 1),  # the capped no-offload runs ran although the cap should have stopped them
        ({"log1-cap-90-no-offload", "log1-cap-50-no-offload"}, 0),  # as meant: only those fail
        ({"log1-no-offload", "log1-full-offload-auto"}, 1),  # every run failed
        ({"log1-cap-90-no-offload", "log1-cap-50-no-offload", "log1-cap-90-step"}, 1),
    ],
)
def test_exit_status_says_whether_every_run_did_what_it_must(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, failing: set, status: int
) -> None:
    code, calls = run_main(monkeypatch, ["--out", str(tmp_path), "--log-intervals", "1"], fake_run(failing))
    assert code == status
    out = capsys.readouterr().out
    assert ("did not do what they must" in out) is bool(status)
    assert (tmp_path / "table.txt").is_file()
    if "log1-no-offload" not in failing:
        assert len(calls) == len(rows.MATRIX)  # the whole matrix ran (capped runs took their cap from it)
    assert all(argv[0] == "scripts/pretrain_gpt.py" and env is None for _, argv, env in calls)  # no upstream rows


def test_our_rows_go_through_the_launcher_and_upstream_rows_through_upstreams_own_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    fails = {"log1-cap-90-no-offload", "log1-cap-50-no-offload"}
    (tmp_path / "ml").mkdir()
    (tmp_path / "ml" / "pretrain_gpt.py").write_text("")
    script = str(tmp_path / "ml" / "pretrain_gpt.py")
    args = ["--megatron-lm", str(tmp_path / "ml"), "--upstream-megatron-lm", str(upstream), "--out",
            str(tmp_path / "o"), "--log-intervals", "1"]  # fmt: skip
    code, calls = run_main(monkeypatch, args, fake_run(fails))
    assert code == 0
    ours = [(n, a) for n, a, env in calls if env is None]
    theirs = {n: (a, env) for n, a, env in calls if env is not None}
    assert len(ours) == len(rows.MATRIX) and all(a[:3] == ["-m", "megatron_offload.run", script]
                                                 for _, a in ours)  # fmt: skip
    assert sorted(theirs) == ["log1-upstream-chunked-offload", "log1-upstream-no-offload"]
    chunked, env = theirs["log1-upstream-chunked-offload"]
    plain, _ = theirs["log1-upstream-no-offload"]
    assert chunked[0] == str(upstream / "pretrain_gpt.py") and "megatron_offload.run" not in chunked
    assert "--config" not in chunked and "--num-layers=20" in chunked  # the config file, as flags upstream parses
    assert chunked[-3:] == ["--chunked-optimizer-state-offload", "--optimizer-state-offload-chunk-size-mb", "512"]
    assert "--chunked-optimizer-state-offload" not in plain and "--offload-optimizer-states" not in plain + chunked
    assert chunked[:-3] == plain  # same model and flags
    assert env["PYTHONPATH"].split(":")[0] == str(upstream.resolve())
    assert env["MAKEFLAGS"].endswith(f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}")


def test_upstream_rows_are_compared_with_upstreams_own_base(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    fails = {"log1-cap-90-no-offload", "log1-cap-50-no-offload"}
    step_ms = {"log1-no-offload": 10.0, "log1-upstream-no-offload": 20.0, "log1-upstream-chunked-offload": 30.0}
    losses = {"log1-upstream-no-offload": {1: 2.5}, "log1-upstream-chunked-offload": {1: 2.5}}  # not ours: {5: 1.0}
    args = ["--upstream-megatron-lm", str(upstream), "--out", str(tmp_path), "--log-intervals", "1"]
    code, _ = run_main(monkeypatch, args, fake_run(fails, step_ms, losses))
    runs = json.loads((tmp_path / "side_by_side.json").read_text())["runs"]["log-interval 1"]
    assert code == 0
    assert runs["upstream chunked offload"]["x_base"] == pytest.approx(1.5)  # 30 / 20, not 30 / 10
    assert runs["upstream chunked offload"]["losses_equal"] is True
    assert runs["upstream no offload"]["x_base"] == pytest.approx(1.0)
    assert "upstream no offload" in (tmp_path / "table.txt").read_text()

    losses["log1-upstream-chunked-offload"] = {1: 2.5000001}  # a loss that differs from upstream's base: a failure
    code, _ = run_main(monkeypatch, args, fake_run(fails, step_ms, losses))
    assert code == 1


def test_only_narrows_upstreams_rows_and_keeps_their_base(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    base_args = ["--upstream-megatron-lm", str(upstream), "--out", str(tmp_path), "--log-intervals", "1", "--only"]
    _, calls = run_main(monkeypatch, [*base_args, "upstream chunked offload"], fake_run(set()))
    assert [name for name, _, _ in calls] == ["log1-no-offload", "log1-upstream-no-offload",
                                               "log1-upstream-chunked-offload"]  # fmt: skip
    _, calls = run_main(monkeypatch, [*base_args, "prefetch step"], fake_run(set()))
    assert [name for name, _, _ in calls] == ["log1-no-offload", "log1-prefetch-step"]


def test_profiled_runs_are_separate_and_their_traces_compared(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    args = ["--upstream-megatron-lm", str(upstream), "--out", str(tmp_path), "--log-intervals", "1", "--profile",
            "--profile-only"]  # fmt: skip
    code, calls = run_main(monkeypatch, args, fake_run(set()))
    assert code == 0
    assert [name for name, _, _ in calls] == [f"profiled-{rows.slug(n)}" for n in [*rows.PROFILED, *UPSTREAM_ROWS]]
    for _, argv, _ in calls:
        assert argv[argv.index("--profile-step-start") + 1] == "7" and "--use-pytorch-profiler" in argv
        assert argv[argv.index("--train-iters") + 1] == str(profile.PROFILE_END + 1)
    results = json.loads((tmp_path / "side_by_side.json").read_text())
    assert results["runs"] == {}  # --profile-only: no timing runs, and no profiled time in the table
    trace = results["trace"]
    assert sorted(trace) == ["full offload (auto)", "prefetch step", "upstream chunked offload"]
    assert trace["upstream chunked offload"]["base_run"] == "upstream no offload"
    assert trace["full offload (auto)"]["base_run"] == "no offload"
    first = trace["prefetch step"]["iterations"][0]
    assert first["share"] == pytest.approx(0.4) and first["base_share"] == pytest.approx(0.8)
    assert trace["prefetch step"]["verdict"].startswith("FAIL")
    table = (tmp_path / "table.txt").read_text()
    assert "their times are not the table's ms/iter" in table and "verdict: FAIL" in table
    assert (tmp_path / "trace_summary.json").is_file() and (tmp_path / "trace_table.txt").is_file()


def test_a_profiled_run_without_its_trace_is_a_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_trace(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        return {"argv": argv, "returncode": 0, "losses": {1: 1.0}, "step_ms": 10.0}

    args = ["--out", str(tmp_path), "--log-intervals", "1", "--profile", "prefetch step", "--profile-only"]
    code, calls = run_main(monkeypatch, args, no_trace)
    assert code == 1 and [name for name, _, _ in calls] == ["profiled-no-offload", "profiled-prefetch-step"]
    trace = json.loads((tmp_path / "side_by_side.json").read_text())["trace"]
    assert trace["prefetch step"]["error"] == "no trace of no offload, prefetch step"


def test_profile_plan_bases() -> None:
    assert profile.profile_plan(["upstream chunked offload"], True) == [
        ("upstream no offload", None), ("upstream chunked offload", "upstream no offload")]  # fmt: skip
    # upstream's offload against our no-offload trace when only that one is profiled
    assert profile.profile_plan(["no offload", "upstream chunked offload"], True) == [
        ("no offload", None), ("upstream chunked offload", "no offload")]  # fmt: skip
    assert profile.profile_plan([], False) == [("no offload", None), ("full offload (auto)", "no offload"),
                                            ("prefetch step", "no offload")]  # fmt: skip
    with pytest.raises(SystemExit, match="cap 90%: step"):
        profile.profile_plan(["cap 90%: step"], False)
    with pytest.raises(SystemExit, match="upstream rows need"):
        profile.profile_plan(["upstream chunked offload"], False)


def test_prepare_upstream_borrows_the_installed_helpers_only_for_the_same_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    site = tmp_path / "site"
    (site / "megatron" / "core" / "datasets").mkdir(parents=True)
    (site / "megatron" / "core" / "datasets" / f"helpers_cpp{suffix}").write_bytes(b"\x7fELF built")
    (site / "megatron" / "core" / "datasets" / "helpers.cpp").write_text("int a;")
    (upstream / "megatron" / "core" / "datasets" / "helpers.cpp").write_text("int b;")
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    assert "builds them" in side_upstream.prepare_upstream(upstream)  # another source: upstream's make builds its own
    assert not list((upstream / "megatron" / "core" / "datasets").glob("helpers_cpp*"))
    (upstream / "megatron" / "core" / "datasets" / "helpers.cpp").write_text("int a;")
    assert "same helpers.cpp" in side_upstream.prepare_upstream(upstream)
    assert (upstream / "megatron" / "core" / "datasets" / f"helpers_cpp{suffix}").read_bytes() == b"\x7fELF built"
    assert "already built" in side_upstream.prepare_upstream(upstream)
    with pytest.raises(SystemExit, match="no pretrain_gpt.py"):
        side_upstream.prepare_upstream(tmp_path / "nowhere")


def test_the_summary_table_gives_each_trace_verdict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, upstream: Path
) -> None:
    from benchmarks import summarize

    args = ["--upstream-megatron-lm", str(upstream), "--out", str(tmp_path / "trace"), "--log-intervals", "1",
            "--profile", "no offload", "upstream chunked offload", "--profile-only"]  # fmt: skip
    assert run_main(monkeypatch, args, fake_run(set()))[0] == 0
    capsys.readouterr()
    summarize.trace_verdicts(tmp_path)
    lines = [line for line in capsys.readouterr().out.splitlines() if " vs " in line]
    assert len(lines) == 1 and lines[0].split()[:6] == ["upstream", "chunked", "offload", "vs", "no", "offload"]
    # busy 70 of 80 ms, share 0.4 against 0.8 in the copy window
    assert "busy x0.875-0.875, share in copy windows x0.50: FAIL: busy time off by more than 3%; busy share" in lines[0]


def test_without_make_a_built_module_needs_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Path
) -> None:
    monkeypatch.setattr(side_upstream.shutil, "which", lambda name: None)
    assert "PATH" not in side_upstream.upstream_env(upstream, tmp_path)  # nothing built: upstream's make must build it
    (upstream / "megatron" / "core" / "datasets" / "helpers_cpp.so").write_bytes(b"")
    env = side_upstream.upstream_env(upstream, tmp_path)
    shim = Path(env["PATH"].split(os.pathsep)[0]) / "make"
    assert subprocess.run([str(shim), "-C", "x"], capture_output=True).returncode == 0
