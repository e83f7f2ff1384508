"""The crash entries' judgement, on the CPU: what they read from Megatron's logs and checkpoint
directories, and the bitwise comparison of two torch_dist (DCP) checkpoints. The runs themselves need
a GPU (tests/drills/integration.py --only crash-after-step crash-backward crash-checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tests.drills import crash_checks, crash_verdict, drill_checkpoints, drill_runs


def line(i: int, loss: str, norm: str) -> str:
    return (
        f" [2026-11-22 00:38:36] iteration {i:8d}/      20 | consumed samples: {8 * i:12d} | global batch size:     8 "
        f"| lm loss: {loss} | loss scale: 1.0 | grad norm: {norm} | number of skipped iterations:   0 |"
    )


def log(iterations: range, loss: str = "1.0E+01", first_loss: str | None = None) -> str:
    lines = [line(i, first_loss if first_loss and i == iterations[0] else loss, f"{i}.5") for i in iterations]
    return "\n".join(lines)


def test_losses_and_grad_norms_are_read_as_printed() -> None:
    assert drill_checkpoints.losses_and_grad_norms(line(11, "1.037512E+01", "11.237")) == {
        11: ("1.037512E+01", "11.237")
    }


def save(directory: Path, state: dict) -> None:
    dcp.save(state, checkpoint_id=str(directory))  # one process, no process group: as Megatron's files


def test_final_checkpoints_are_compared_bit_for_bit(tmp_path: Path) -> None:
    params = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3)}, "optimizer": {"exp_avg": torch.randn(7)}}
    params["rng"] = torch.arange(5056, dtype=torch.uint8)  # as megatron-core's torch_rng_state
    save(tmp_path / "a" / "iter_0000020", params)
    save(tmp_path / "b" / "iter_0000020", params)
    a, b = (drill_checkpoints.fingerprints(tmp_path / d / "iter_0000020", tmp_path) for d in ("a", "b"))
    assert len(a) == 4 and drill_checkpoints.tensor_differences(a, b) == {}
    changed = {"model": dict(params["model"]), "optimizer": {"exp_avg": params["optimizer"]["exp_avg"].clone()}}
    changed["optimizer"]["exp_avg"][3] = torch.nextafter(changed["optimizer"]["exp_avg"][3], torch.tensor(1e9))
    changed["model"]["b"] = -params["model"]["b"]  # -0.0: numerically equal, other bits
    changed["rng"] = params["rng"].clone()
    save(tmp_path / "c" / "iter_0000020", changed)
    c = drill_checkpoints.fingerprints(tmp_path / "c" / "iter_0000020", tmp_path)
    assert sorted(drill_checkpoints.tensor_differences(a, c)) == ["model/b", "optimizer/exp_avg"]
    del c["model/w"]
    assert drill_checkpoints.tensor_differences(a, c)["model/w"] == (a["model/w"], drill_checkpoints.ABSENT)
    assert a["rng"].startswith("uint8 (5056,) sha256:")


def test_a_save_cut_short_is_seen_and_the_tracker_names_the_last_complete_one(tmp_path: Path) -> None:
    save(tmp_path / "iter_0000010", {"w": torch.ones(2)})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    cut = tmp_path / "iter_0000015"
    cut.mkdir()
    (cut / "__0_0.distcp").write_bytes(b"half a file")  # the kill came before .metadata and the tracker
    assert drill_checkpoints.last_complete_iteration(tmp_path) == 10
    assert drill_checkpoints.cut_short(tmp_path) == ["iter_0000015"]


def results(killed_rc: int = -9) -> dict:
    return {"uninterrupted": {"returncode": 0}, "killed": {"returncode": killed_rc}, "resumed": {"returncode": 0}}


def logs(resumed: str, marker: str) -> dict[str, str]:
    return {"uninterrupted": log(range(1, 21)), "killed": marker, "resumed": resumed}


LOADED = "  successfully loaded checkpoint from /tmp/x [ t 1/1, gtp_remat 1/1, p 1/1 ] at iteration 10\n"


def test_a_good_resume_passes_its_checks_and_each_failure_is_named() -> None:
    marker = f"{drill_runs.CRASH_MARKER} after the step of iteration 13, pending copy-out bytes 4096"
    facts = {"tracker_after_kill": 10, "cut_short_after_kill": []}
    good = LOADED + log(range(11, 21))
    assert crash_checks.check("after-step", 13, results(), logs(good, marker), facts) == []
    assert facts["resumed_loaded"] == [10] and facts["kill"] == marker
    nothing_pending = marker.replace("4096", "0")
    failures = crash_checks.check("after-step", 13, results(), logs(good, nothing_pending), dict(facts))
    assert failures == ["killed: no copy to host was in flight at the kill"]
    control_marker = f"{drill_runs.CRASH_MARKER} after the step of iteration 13 (no offloader attached: the step)"
    control = crash_checks.check("after-step", 13, results(), logs(good, control_marker), dict(facts), offloaded=False)
    assert control == []  # without offloading there are no copies to be in flight
    failures = crash_checks.check("checkpoint", 15, results(killed_rc=0), logs(log(range(1, 21)), ""), dict(facts))
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
    marker = f"{drill_runs.CRASH_MARKER} after the step of iteration 13, pending copy-out bytes 4096"
    good = LOADED + log(range(11, 21))
    stopped = results() | {"resumed": {"returncode": None, "stopped": "no exit within 150 s", "verdict": "VERDICT"}}
    (tmp_path / "iter_0000010").mkdir()  # named by the tracker, but without .metadata: not a whole save
    facts = {"tracker_after_kill": 10, "cut_short_after_kill": []}
    failures = crash_checks.check("after-step", 13, stopped, logs(good, marker), facts, tmp_path)
    assert failures == ["VERDICT", "the tracker names iteration 10, whose save has no .metadata (incomplete)"]
    assert facts["tracker_names_complete_save"] is False


def test_the_phase_a_verdict_names_comes_from_the_log() -> None:
    assert drill_runs.phase("") == "before its first iteration"
    assert drill_runs.phase(log(range(1, 13))) == "after iteration 12"
    assert drill_runs.phase(log(range(1, 13)) + "\n" + drill_runs.CRASH_MARKER + " x") == (
        "after iteration 12, after its SIGKILL line"
    )
    assert drill_runs.phase(LOADED) == "after loading the checkpoint of iteration 10, before its first iteration"


# ------------------------------------------------------------------- the control comparison (verdict)
# What the H100 showed: the resumed run's iteration-12 loss and the final CPU RNG state differ from the
# uninterrupted run's, with offloading and without alike.
LOSS_12 = ("9.516481E+00", "9.488976E+00")
RNG = "final checkpoint rng_state/0/random_rng_state/torch_rng_state"
RNG_PAIR = ("uint8 (5056,) sha256:aaaa", "uint8 (5056,) sha256:bbbb")


def resumed_with(changes: dict[int, str]) -> str:
    losses = {i: f"{9 + i / 100:.6E}" for i in range(11, 21)} | changes
    return LOADED + "\n".join(line(i, losses[i], f"{i}.5") for i in range(11, 21))


def test_logged_differences_are_every_loss_and_grad_norm_as_printed() -> None:
    uninterrupted = "\n".join(line(i, f"{9 + i / 100:.6E}", f"{i}.5") for i in range(1, 21))
    iterations = list(range(11, 21))
    assert crash_verdict.logged_differences(uninterrupted, resumed_with({}), iterations) == {}
    found = crash_verdict.logged_differences(uninterrupted, resumed_with({12: "9.488976E+00"}), iterations)
    assert found == {"iteration 12 lm loss": ("9.120000E+00", "9.488976E+00")}
    missing = crash_verdict.logged_differences(uninterrupted, LOADED + log(range(11, 20)), [20])
    assert missing == {
        "iteration 20 lm loss": ("9.200000E+00", "absent"),
        "iteration 20 grad norm": ("20.5", "absent"),
    }


def test_a_resume_bitwise_equal_passes() -> None:
    verdict = crash_verdict.judge({}, {})
    assert verdict.status == crash_verdict.PASS and verdict.failures == verdict.megatron_core == []
    assert verdict.line().startswith("pass")


def test_a_difference_the_control_shows_as_well_is_megatron_cores_and_not_a_failure() -> None:
    ours = {"iteration 12 lm loss": LOSS_12, RNG: RNG_PAIR}
    verdict = crash_verdict.judge(ours, dict(ours))
    assert verdict.status == crash_verdict.MEGATRON_CORE and verdict.failures == []
    assert verdict.megatron_core == [
        "iteration 12 lm loss: 9.516481E+00 uninterrupted, 9.488976E+00 resumed; the same without offloading",
        f"{RNG}: {RNG_PAIR[0]} uninterrupted, {RNG_PAIR[1]} resumed; the same without offloading",
    ]
    assert verdict.line().startswith("megatron-core's difference: iteration 12 lm loss")


def test_a_difference_in_both_runs_is_megatron_cores_one_only_in_ours_fails() -> None:
    ours = {"iteration 12 lm loss": LOSS_12, "final checkpoint optimizer/exp_avg": ("sha256:1", "sha256:2")}
    verdict = crash_verdict.judge(ours, {"iteration 12 lm loss": LOSS_12})
    assert verdict.status == crash_verdict.FAIL
    assert [d.split(":")[0] for d in verdict.megatron_core] == ["iteration 12 lm loss"]
    assert verdict.failures == [
        "final checkpoint optimizer/exp_avg: sha256:1 uninterrupted, sha256:2 resumed; "
        "the run without offloading resumed equal"
    ]
    assert verdict.line().startswith("FAIL: final checkpoint optimizer/exp_avg")


def test_the_same_start_resumed_to_another_value_than_the_control_fails() -> None:
    """Both resumes differ at iteration 12, but from the same uninterrupted loss to different values:
    offloading changed what megatron-core's resume does there, so it is not megatron-core's alone."""
    verdict = crash_verdict.judge({"iteration 12 lm loss": LOSS_12}, {"iteration 12 lm loss": (LOSS_12[0], "9.4")})
    assert verdict.status == crash_verdict.FAIL and verdict.megatron_core == []
    assert verdict.failures[0].endswith("without offloading the same start resumed to 9.4")


def test_without_a_control_every_difference_fails_and_the_controls_own_are_reported() -> None:
    verdict = crash_verdict.judge({"iteration 12 lm loss": LOSS_12}, None, ["without offloading: killed run ..."])
    assert verdict.status == crash_verdict.FAIL
    assert verdict.failures == [
        "without offloading: killed run ...",
        "iteration 12 lm loss: 9.516481E+00 uninterrupted, 9.488976E+00 resumed (no control to tell whose)",
    ]
    only_control = crash_verdict.judge({}, {"iteration 12 lm loss": LOSS_12})
    assert only_control.status == crash_verdict.PASS and len(only_control.control_only) == 1
    failed_check = crash_verdict.judge({}, {}, ["the tracker names iteration 5, expected 10"])
    assert failed_check.status == crash_verdict.FAIL
