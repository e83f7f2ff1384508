"""benchmarks/step_start.py on a small synthetic trace: the compute stream's idle stretches before the update,
each held by the host (its next kernel started at its launch) or by the device, the Python frames in the host's,
nested under those holding the whole stretch, and the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import step_start
from tests.chrome_traces import annotation, frame, kernel, launch, memcpy, step, write

STEP_NAME = "Optimizer.step#StreamedStep.step"


def iteration() -> list[dict]:
    """Iteration 5 (0-300 ms). The backward's kernel runs to 100 ms (launched at 50: the host was ahead); the
    gradient norm's at 130-140, launched at 129.95 (the GPU waited for the host); a kernel at 150-155 launched at
    120 (it waited on the device); the update's first kernel at 175-180, launched at 174.96 inside the step's range.
    Copies out at 182 and 200 ms. Frames: megatron-core's finalize 95-105; the step wrapper 105-185 holding our
    bring-back 106-126 (its flush 110-125) and megatron-core's step 127-182 (its update 156-175)."""
    return [
        step(5, 0, 300),
        launch(50, 1),
        kernel(0, 100, correlation=1),
        launch(129.95, 2),
        kernel(130, 10, correlation=2),
        launch(120, 3),
        kernel(150, 5, correlation=3),
        annotation(STEP_NAME, 170, 10),
        launch(174.96, 4),
        kernel(175, 5, correlation=4),
        memcpy(182, 10, "d2h"),
        memcpy(200, 10, "d2h"),
        frame("finalize_model_grads", 95, 10),
        frame("step_with_offload", 105, 80),
        frame("bring_back_for_step", 106, 20),
        frame("flush", 110, 15),
        frame("optimizer.step", 127, 55),
        frame("step_with_ready_grads", 156, 19),
    ]


def test_each_idle_stretch_with_who_held_it_and_the_frames_in_the_hosts(tmp_path: Path) -> None:
    (row,) = step_start.summarize(write(tmp_path / "t.json", iteration()), "Optimizer.step", 80, 1, 0.5, 3)
    window = row["window"]
    assert row["iteration"] == "ProfilerStep#5" and window["first_copy_out_ms"] == 7.0
    assert (window["host_held_ms"], window["device_held_ms"]) == (50.0, 10.0)
    spans = [(s["start"], s["end"], s["held"]) for s in window["stretches"]]
    assert spans == [(-75.0, -45.0, "host"), (-35.0, -25.0, "device"), (-20.0, 0.0, "host")]
    norm, on_device, update = window["stretches"]
    assert norm["frames"] == [
        (0, -5.0, 5.0, "finalize_model_grads"),
        (0, 5.0, 25.0, "step_with_offload"),
        (1, 6.0, 20.0, "bring_back_for_step"),
        (2, 10.0, 15.0, "flush"),
        (1, 27.0, 3.0, "optimizer.step"),
    ]
    assert on_device["frames"] == []  # the device held it: no host frame explains it
    # The step wrapper and megatron-core's step hold all of it: the levels count under them.
    assert update["frames"] == [(0, 1.0, 19.0, "step_with_ready_grads")]


def test_depth_and_shortest_frame_and_gap_bound_what_is_listed(tmp_path: Path) -> None:
    path = write(tmp_path / "t.json", iteration())
    (row,) = step_start.summarize(path, "Optimizer.step", 80, 1, 4.0, 1)
    norm = row["window"]["stretches"][0]
    assert norm["frames"] == [(0, -5.0, 5.0, "finalize_model_grads"), (0, 5.0, 25.0, "step_with_offload")]
    (row,) = step_start.summarize(path, "Optimizer.step", 80, 15, 0.5, 3)
    assert [s["held"] for s in row["window"]["stretches"]] == ["host", "host"]  # the 10 ms stretch left out
    (row,) = step_start.summarize(path, "Optimizer.step", 30, 1, 0.5, 3)
    # The window opens at -30 ms: the stretch open then counts from there.
    assert [(s["start"], s["end"]) for s in row["window"]["stretches"]] == [(-30.0, -25.0), (-20.0, 0.0)]


def test_command_line_no_range_and_an_unreadable_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "rank-0.json.gz", iteration(), gz=True)
    assert step_start.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "compute stream idle 50.0 ms waiting for the host, 10.0 ms waiting on the device" in out
    assert "-20.0 to    +0.0 ms idle, held by the host" in out and "step_with_ready_grads" in out
    assert step_start.main([str(path), "--range", "Optimizer.zero_grad"]) == 0
    assert "no range named Optimizer.zero_grad... launched a kernel" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("not a trace")
    assert step_start.main([str(tmp_path / "bad.json")]) == 2
    assert capsys.readouterr().err.startswith("step_start: ")


def test_a_kernel_without_its_launch_leaves_its_stretch_unknown(tmp_path: Path) -> None:
    """A trace that lost the launch of the kernel after a stretch says so, and counts it as neither's."""
    events = [step(5, 0, 300), kernel(100, 10), kernel(130, 10), annotation(STEP_NAME, 150, 10), launch(154.99, 4)]
    events.append(kernel(155, 5, correlation=4))
    (row,) = step_start.summarize(write(tmp_path / "t.json", events), "Optimizer.step", 80, 1, 0.5, 3)
    window = row["window"]
    assert [(s["start"], s["held"]) for s in window["stretches"]] == [(-45.0, "unknown"), (-15.0, "host")]
    assert (window["host_held_ms"], window["device_held_ms"]) == (15.0, 0.0)
    assert window["first_copy_out_ms"] == 0.0  # no copy out after the update: the window ends at it
