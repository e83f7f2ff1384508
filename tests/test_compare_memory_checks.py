"""The nightly memory comparison's checks on recorded logs: each check failing on its own, the step-time
floor following the measured link, the capped rows' checks, and the strict thresholds file."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.memory_checks import ThresholdsError, load_thresholds
from tests.compare_memory_helpers import DATA, ROOT, failing, logs_dir, verdict


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


def again_dir(tmp_path: Path, log: Path = DATA / "baseline-again.log", **replace: tuple[str, str]) -> Path:
    """A --from-logs folder with a second no-offload run, after the offload rows: ``log``."""
    (tmp_path / "again").mkdir()
    folder = logs_dir(tmp_path / "again", **replace)
    shutil.copy(log, folder / "baseline-again.log")
    return folder


def test_the_floors_take_no_offload_from_both_runs_around_the_offload_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No offload ran 600 ms an iteration before the offload rows and 800 after them (the host slowed in
    between): the floors take both runs' steady iterations together (700 ms), so a capped default at 750 ms,
    over its threshold against the first run alone, passes; x no offload divides by the same time."""
    slow = {"capped_default": ("iteration (ms): 6", "iteration (ms): 7")}
    _, _, alone = verdict(logs_dir(tmp_path, **slow), capsys)
    assert failing(alone) == ["step_time_capped_default"]
    code, out, report = verdict(again_dir(tmp_path, **slow), capsys)
    assert code == 0, out
    assert report["measured"]["no_offload_ms"] == pytest.approx((601.2 + 798.9) / 2)
    floor, floor_alone = (r["measured"]["floors"]["capped-default"]["floor_ms"] for r in (report, alone))
    # The first forward (a third of one of 4 micro-batches' share) grows with no offload and hides more copies out.
    assert floor - floor_alone == pytest.approx((1 - 1 / 12) * ((601.2 + 798.9) / 2 - 600.15))
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "step_time_capped_default")
    assert "600.1 before the offload rows, 800.8 after" in detail
    assert "losses_equal_baseline_again" in [c["name"] for c in report["checks"]]
    page = (tmp_path / "again" / "logs" / "report.md").read_text()
    assert "| baseline | `—` | ok | 600.1 (599-601) | 0.857 |" in page  # against 700 ms


def test_a_second_no_offload_run_with_other_losses_fails_and_one_that_did_not_run_through_leaves_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No offload twice must log the same losses, or no bitwise check means anything; a second run that stopped
    leaves the floors on the first run and is not compared."""
    other = tmp_path / "other.log"
    other.write_text((DATA / "baseline-again.log").read_text().replace("lm loss: 9.887412E+00", "lm loss: 9.9E+00"))
    _, _, report = verdict(again_dir(tmp_path, other), capsys)
    assert failing(report) == ["losses_equal_baseline_again"]
    stopped = tmp_path / "stopped.log"
    stopped.write_text("".join((DATA / "baseline-again.log").read_text().splitlines(keepends=True)[:52]))
    (tmp_path / "second").mkdir()
    code, out, report = verdict(again_dir(tmp_path / "second", stopped), capsys)
    assert code == 0, out
    assert report["runs"]["baseline-again"]["summary"]["status"] == "not available"
    assert report["measured"]["no_offload_ms"] == pytest.approx(600.15)
    assert "losses_equal_baseline_again" not in [c["name"] for c in report["checks"]]
