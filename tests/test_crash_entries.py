"""The crash entries' judgement, on the CPU: what they read from Megatron's logs and checkpoint
directories, and the bitwise comparison of two torch_dist (DCP) checkpoints. The runs themselves need
a GPU (scripts/integration.py --only crash-after-step crash-backward crash-checkpoint).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # scripts, not a package

import crash_entries  # noqa: E402


def line(i: int, loss: str, norm: str) -> str:
    return (
        f" [2026-11-22 00:38:36] iteration {i:8d}/      20 | consumed samples: {8 * i:12d} | global batch size:     8 "
        f"| lm loss: {loss} | loss scale: 1.0 | grad norm: {norm} | number of skipped iterations:   0 |"
    )


def log(iterations: range, loss: str = "1.0E+01", first_loss: str | None = None) -> str:
    lines = [line(i, first_loss if first_loss and i == iterations[0] else loss, f"{i}.5") for i in iterations]
    return "\n".join(lines)


def test_losses_and_grad_norms_are_read_as_printed() -> None:
    assert crash_entries.losses_and_grad_norms(line(11, "1.037512E+01", "11.237")) == {11: ("1.037512E+01", "11.237")}


def save(directory: Path, state: dict) -> None:
    dcp.save(state, checkpoint_id=str(directory))  # one process, no process group: as Megatron's files


def test_final_checkpoints_are_compared_bit_for_bit(tmp_path: Path) -> None:
    params = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3)}, "optimizer": {"exp_avg": torch.randn(7)}}
    save(tmp_path / "a" / "iter_0000020", params)
    save(tmp_path / "b" / "iter_0000020", params)
    a, b = (crash_entries.checkpoint_tensors(tmp_path / d / "iter_0000020", tmp_path) for d in ("a", "b"))
    assert crash_entries.compare_checkpoints(a, b) == (3, [])
    changed = dict(b, **{"optimizer/exp_avg": b["optimizer/exp_avg"].clone()})
    changed["optimizer/exp_avg"][3] = torch.nextafter(changed["optimizer/exp_avg"][3], torch.tensor(1e9))  # one ulp
    changed["model/b"] = -changed["model/b"]  # -0.0: numerically equal, other bits
    compared, differences = crash_entries.compare_checkpoints(a, changed)
    assert compared == 3 and [d.split(":")[0] for d in differences] == ["model/b", "optimizer/exp_avg"]
    del changed["model/w"]
    assert "model/w: only in one checkpoint" in crash_entries.compare_checkpoints(a, changed)[1]


def test_a_save_cut_short_is_seen_and_the_tracker_names_the_last_complete_one(tmp_path: Path) -> None:
    save(tmp_path / "iter_0000010", {"w": torch.ones(2)})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    cut = tmp_path / "iter_0000015"
    cut.mkdir()
    (cut / "__0_0.distcp").write_bytes(b"half a file")  # the kill came before .metadata and the tracker
    assert crash_entries.last_complete_iteration(tmp_path) == 10
    assert crash_entries.cut_short(tmp_path) == ["iter_0000015"]


def results(killed_rc: int = -9) -> dict:
    return {"uninterrupted": {"returncode": 0}, "killed": {"returncode": killed_rc}, "resumed": {"returncode": 0}}


def logs(resumed: str, marker: str) -> dict[str, str]:
    return {"uninterrupted": log(range(1, 21)), "killed": marker, "resumed": resumed}


LOADED = "  successfully loaded checkpoint from /tmp/x [ t 1/1, gtp_remat 1/1, p 1/1 ] at iteration 10\n"


def test_a_good_resume_passes_and_each_failure_is_named() -> None:
    marker = f"{crash_entries.CRASH_MARKER} after the step of iteration 13, pending copy-out bytes 4096"
    facts = {"tracker_after_kill": 10, "cut_short_after_kill": []}
    good = LOADED + log(range(11, 21))
    assert crash_entries.check("after-step", 13, results(), logs(good, marker), facts) == []
    assert facts["losses_after_load"] == {11: ["1.0E+01", "1.0E+01"], 12: ["1.0E+01", "1.0E+01"]}
    first_differs = crash_entries.check(
        "after-step", 13, results(), logs(LOADED + log(range(11, 21), "1.0E+01", "9.9E+00"), marker), {**facts}
    )
    assert first_differs == ["iteration 11: loss 9.9E+00 resumed, 1.0E+01 uninterrupted"]
    nothing_pending = marker.replace("4096", "0")
    failures = crash_entries.check("after-step", 13, results(), logs(good, nothing_pending), dict(facts))
    assert failures == ["killed: no copy to host was in flight at the kill"]
    bad = LOADED + log(range(11, 21)).replace(
        "lm loss: 1.0E+01 | loss scale: 1.0 | grad norm: 17.5", "lm loss: 2.0E+01 | loss scale: 1.0 | grad norm: 17.6"
    )
    failures = crash_entries.check("backward", 13, results(), logs(bad, marker), dict(facts))
    assert [f.split(":")[0] for f in failures] == ["iteration 17", "iteration 17"]
    failures = crash_entries.check("checkpoint", 15, results(killed_rc=0), logs(log(range(1, 21)), ""), dict(facts))
    assert failures == [
        "killed run never reached its kill point (checkpoint of iteration 15): it ended before its first iteration, "
        "exit 0; last log lines: (empty log)",
        "saves left incomplete by the kill: [], expected ['iter_0000015']",
        "resumed: no 'successfully loaded checkpoint ... at iteration 10' in the log ([])",
        f"resumed: logged iterations {list(range(1, 21))}, expected {list(range(11, 21))}",
    ]


def test_a_run_the_drill_stopped_fails_with_its_verdict_and_a_tracker_on_an_incomplete_save_is_caught(
    tmp_path: Path,
) -> None:
    marker = f"{crash_entries.CRASH_MARKER} after the step of iteration 13, pending copy-out bytes 4096"
    good = LOADED + log(range(11, 21))
    stopped = results() | {"resumed": {"returncode": None, "stopped": "no exit within 150 s", "verdict": "VERDICT"}}
    (tmp_path / "iter_0000010").mkdir()  # named by the tracker, but without .metadata: not a whole save
    facts = {"tracker_after_kill": 10, "cut_short_after_kill": []}
    failures = crash_entries.check("after-step", 13, stopped, logs(good, marker), facts, tmp_path)
    assert failures == ["VERDICT", "the tracker names iteration 10, whose save has no .metadata (incomplete)"]
    assert facts["tracker_names_complete_save"] is False


def test_the_phase_a_verdict_names_comes_from_the_log() -> None:
    assert crash_entries.phase("") == "before its first iteration"
    assert crash_entries.phase(log(range(1, 13))) == "after iteration 12"
    assert crash_entries.phase(log(range(1, 13)) + "\n" + crash_entries.CRASH_MARKER + " x") == (
        "after iteration 12, after its SIGKILL line"
    )
    assert crash_entries.phase(LOADED) == "after loading the checkpoint of iteration 10, before its first iteration"


def test_the_second_loss_after_a_load_is_the_mean_of_the_first_two_as_megatron_prints_it() -> None:
    """Megatron 0.19's training_log keeps its loss sums after a run's first iteration (should_reset = not
    is_first_iteration), so a resumed run's second line prints the mean of its first two losses: seen on
    an H100, with every grad norm and every later loss equal."""
    losses = {i: f"{9 + i / 100:.6E}" for i in range(1, 21)}
    uninterrupted = "\n".join(line(i, losses[i], f"{i}.5") for i in range(1, 21))
    marker = f"{crash_entries.CRASH_MARKER} after the step of iteration 13, pending copy-out bytes 4096"

    def resumed(second: str) -> str:
        return LOADED + "\n".join(line(i, second if i == 12 else losses[i], f"{i}.5") for i in range(11, 21))

    facts = {"tracker_after_kill": 10, "cut_short_after_kill": []}
    mean = resumed("9.115000E+00")  # (9.11 + 9.12) / 2
    assert (
        crash_entries.check(
            "after-step", 13, results(), {"uninterrupted": uninterrupted, "killed": marker, "resumed": mean}, facts
        )
        == []
    )
    assert "mean of the first two" in facts["second_loss_after_load"]
    off = resumed("9.115100E+00")
    failures = crash_entries.check(
        "after-step", 13, results(), {"uninterrupted": uninterrupted, "killed": marker, "resumed": off}, dict(facts)
    )
    assert failures == ["iteration 12: loss 9.115100E+00 resumed, 9.120000E+00 uninterrupted"]
