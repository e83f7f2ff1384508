"""benchmarks/step_link.py on small synthetic traces: the step's device span found through the launches
inside its ranges, the link's bytes and busy time in it and before it, its idle gaps, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import step_link
from tests.chrome_traces import annotation, kernel, launch, memcpy, step, write

STEP_NAME = "Optimizer.step#AdamW.step"


def one_iteration() -> list[dict]:
    """Iteration 12 (0-600 ms). Two step ranges on the host launch kernels that run at 400-410 and 480-500 ms;
    a kernel launched before them (the backward's) runs at 250 ms. Copies in at 330-390 (before the step),
    400-430 and 450-480 ms (1 GiB each), copies out at 470-495 ms (0.5 GiB), 495.5-510 and 530-540 ms."""
    return [
        step(12, 0, 600),
        annotation(STEP_NAME, 300, 1),
        annotation(STEP_NAME, 320, 1),
        annotation("Optimizer.zero_grad#AdamW.zero_grad", 200, 1),
        launch(300.5, 1),
        launch(320.5, 2),
        launch(200.5, 3),
        kernel(400, 10, correlation=1),
        kernel(480, 20, correlation=2),
        kernel(250, 40, correlation=3),
        kernel(450, 10),
        memcpy(330, 60, "h2d", mib=512),
        memcpy(400, 30, "h2d", mib=1024),
        memcpy(450, 30, "h2d", mib=1024),
        memcpy(470, 25, "d2h", mib=512),
        memcpy(495.5, 14.5, "d2h", mib=256),
        memcpy(530, 10, "d2h", mib=128),
    ]


def test_the_step_span_and_the_link_in_it_and_before_it(tmp_path: Path) -> None:
    (row,) = step_link.summarize(write(tmp_path / "t.json", one_iteration()))
    got = row["step"]
    assert row["iteration"] == "ProfilerStep#12"
    assert got["from_ms"] == 400.0 and got["length_ms"] == 100.0  # the kernel launched at 200.5 ms is not the step's
    assert got["compute_busy_ms"] == 40.0  # 10 + 20 launched in the step, and 10 between them
    assert got["link"] == {"h2d": {"GiB": 2.0, "busy_ms": 60.0}, "d2h": {"GiB": 0.75, "busy_ms": 29.5}}
    assert got["before"] == {"h2d": {"GiB": 0.5, "busy_ms": 60.0}, "d2h": {"GiB": 0.0, "busy_ms": 0.0}}
    assert got["h2d_idle"] == [(30.0, 20.0), (80.0, 20.0)]  # between the copies in, and after the last one
    assert got["d2h_after_ms"] == 10.0  # the copy out to 510 ms (a 0.5 ms pause bridged); the one at 530 is later
    # Behind the step's end: the copy out started at 495.5 ms (256 MiB); the one at 470 ms ended before it.
    assert got["d2h_tail"] == {
        "copies": 1,
        "GiB": 0.25,
        "largest_GiB": 0.25,
        "first_start_ms": -4.5,
        "last_start_ms": -4.5,
    }


def test_gaps_shorter_than_the_bar_and_other_range_names(tmp_path: Path) -> None:
    path = write(tmp_path / "t.json", one_iteration())
    (row,) = step_link.summarize(path, gap_ms=25)
    assert row["step"]["h2d_idle"] == []
    assert row["step"]["d2h_after_ms"] == 40.0  # pauses up to 25 ms bridged: through the copy out at 530-540
    assert row["step"]["d2h_tail"]["copies"] == 2 and row["step"]["d2h_tail"]["last_start_ms"] == 30.0
    (row,) = step_link.summarize(path, prefix="Optimizer.zero_grad")
    assert row["step"]["from_ms"] == 250.0 and row["step"]["length_ms"] == 40.0
    (row,) = step_link.summarize(path, prefix="mo.streamed_step.run")  # not in this trace
    assert row["step"] is None
    said = step_link.text([row], "mo.streamed_step.run", 80, 1)
    assert "no range named mo.streamed_step.run... launched a kernel" in said


def test_command_line_gzip_json_and_an_unreadable_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "rank-0.json.gz", one_iteration(), gz=True)
    assert step_link.main([str(path), "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "the step on the device 100.0 ms, from 400.0 ms into the iteration; compute stream busy 40.0 ms" in out
    assert "in the step: h2d 2.00 GiB, busy 60.0 ms | d2h 0.75 GiB, busy 29.5 ms" in out
    assert "80 ms before it: h2d 0.50 GiB, busy 60.0 ms" in out
    assert "(from+length, ms): 30+20 80+20; d2h busy 10.0 ms past its end" in out
    assert "copies out past its end: 1, 0.25 GiB (largest 0.25), started -4.5 to -4.5 ms from its end" in out
    assert json.loads((tmp_path / "out.json").read_text())[0]["step"]["length_ms"] == 100.0
    (tmp_path / "bad.json").write_text("{")
    assert step_link.main([str(tmp_path / "bad.json")]) == 2
    assert "not a readable chrome trace" in capsys.readouterr().err


def test_the_streamed_steps_range_is_found_by_the_default_name(tmp_path: Path) -> None:
    """The library's streamed step replaces torch's ``Optimizer.step``; its range carries the same prefix."""
    from megatron_offload.megatron.streamed_step_internals import STEP_RANGE

    events = [e for e in one_iteration() if e.get("name") != STEP_NAME]
    events += [annotation(STEP_RANGE, 300, 1), annotation(STEP_RANGE, 320, 1)]
    (row,) = step_link.summarize(write(tmp_path / "t.json", events))
    assert row["step"]["from_ms"] == 400.0 and row["step"]["length_ms"] == 100.0
