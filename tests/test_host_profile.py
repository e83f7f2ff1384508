"""benchmarks/host_profile.py: py-spy's raw stacks read, the main thread's samples within a frame, rows compared."""

from __future__ import annotations

import pytest

from benchmarks import host_profile

FORWARD = "forward_step (core/pipeline_parallel/schedules.py:509)"
LOSS = "calculate_logits_max (core/tensor_parallel/cross_entropy.py:25)"
LINEAR = "linear (core/tensor_parallel/layers.py:576)"


def raw(*lines: tuple[str, list[str], int]) -> str:
    return "\n".join(
        f"thread (1): {thread};" + ";".join(["train (training.py:1)", *frames]) + f" {count}"
        for thread, frames, count in lines
    )


NONE = raw(
    ("MainThread", [FORWARD, LINEAR], 30),
    ("MainThread", ["step (optimizer.py:3)"], 20),
    ("Thread-1", [FORWARD, LINEAR], 50),
)
CAPPED = raw(
    ("MainThread", [FORWARD, LINEAR], 30),
    ("MainThread", [FORWARD, "loss (gpt.py:9)", LOSS], 12),
    ("MainThread", ["step (optimizer.py:3)"], 40),
)


def test_read_raw_keeps_counted_lines_only():
    stacks = host_profile.read_raw(NONE + "\nthread (2): MainThread;cut short")
    assert [count for _, count in stacks] == [30, 20, 50]
    assert stacks[0][0][-1] == LINEAR


def test_profile_counts_the_main_thread_within_the_frame():
    row = host_profile.profile(host_profile.read_raw(CAPPED))
    assert (row.main, row.within) == (82, 42)
    assert row.leaves[LOSS] == 12 and row.leaves["step (optimizer.py:3)"] == 0
    # inclusive by file, from the frame in: the loop above it is not a function of the forward's
    assert (
        row.functions["loss (gpt.py)"] == 12
        and row.functions["forward_step (core/pipeline_parallel/schedules.py)"] == 42
    )
    assert "train (training.py)" not in row.functions
    other = host_profile.profile(host_profile.read_raw(NONE))
    assert (other.main, other.within) == (50, 30)  # Thread-1's samples are not the main thread's


def test_without_thread_frames_every_stack_counts():
    stacks = [([FORWARD, LINEAR], 5), (["step (optimizer.py:3)"], 7)]
    row = host_profile.profile(stacks)
    assert (row.main, row.within) == (12, 5)


def test_table_ranks_by_difference_from_the_first_row_per_iteration(tmp_path, capsys):
    (tmp_path / "none.spy").write_text(NONE)
    (tmp_path / "capped.spy").write_text(CAPPED)
    # 12 s of samples at 500 and 750 ms an iteration: 24 and 16 iterations
    assert (
        host_profile.main(["--seconds", "12", "--top", "1", f"{tmp_path}/none.spy:500", f"{tmp_path}/capped.spy:750"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("samples an iteration")
    lines = out.splitlines()
    assert lines[3].split()[:2] == ["1.2", "2.6"]  # within: 30 / 24 and 42 / 16
    leaf = lines[lines.index(next(line for line in lines if line.startswith("innermost"))) + 1]
    assert leaf.split()[:2] == ["0.0", "0.8"] and leaf.endswith(LOSS)  # 12 / 16, ranked first


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--seconds", "0", "X.spy"], "--seconds 0"),
        (["--seconds", "12", "{tmp}/none.spy:fast"], "ms an iteration"),
        (["--seconds", "12", "{tmp}/missing.spy"], "no such profile"),
        (["--seconds", "12", "{tmp}/none.spy:500", "{tmp}/none.spy"], "every row's ms an iteration"),
    ],
)
def test_bad_input_one_line(tmp_path, capsys, argv, says):
    (tmp_path / "none.spy").write_text(NONE)
    with pytest.raises(SystemExit):
        host_profile.main([arg.format(tmp=tmp_path) for arg in argv])
    assert says in capsys.readouterr().err
