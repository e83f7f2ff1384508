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
    # Megatron's first loss after a load is its own accounting: it may differ without failing.
    good = LOADED + log(range(11, 21), first_loss="9.9E+00")
    assert crash_entries.check("after-step", 13, results(), logs(good, marker), facts) == []
    assert facts["first_loss_after_load"] == ["9.9E+00", "1.0E+01"]
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
        "killed: no SIGKILL at checkpoint of iteration 15 (exit 0)",
        "the save cut short is not left incomplete: []",
        "resumed: no 'successfully loaded checkpoint ... at iteration 10' in the log",
        f"resumed: logged iterations {list(range(1, 21))}, expected {list(range(11, 21))}",
    ]
