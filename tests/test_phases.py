"""benchmarks/phases.py without a GPU: the marks on megatron-core's own schedule function and GPT model
(Megatron-LM's training loop is not installed here: its train_step is a stand-in), one line per iteration
once its events have completed and never before, the medians of a log, the table, and the sweep's text."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import megatron_job as job
from benchmarks import megatron_side_by_side as side
from benchmarks import memory_speed_curve as curve
from benchmarks import phase_lines, phases


class HostEvent:
    """An event on the host's clock; ``ready`` False: not completed until a test says so."""

    ready = True

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return HostEvent.ready

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.at - self.at) * 1e3


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch):
    """megatron-core's schedules module and GPTModel, marked (restored after the test), and an iteration
    that runs ``micro_batches`` forwards through them."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.pipeline_parallel import schedules

    def forward_backward(micro_batches: int) -> None:
        for _ in range(micro_batches):
            gpt_model.GPTModel.forward(None)

    monkeypatch.setattr(schedules, "forward_backward_no_pipelining", forward_backward)
    monkeypatch.setattr(gpt_model.GPTModel, "forward", lambda self: None)
    training = SimpleNamespace(train_step=lambda micro_batches: schedules.forward_backward_no_pipelining(micro_batches))
    said: list[str] = []
    forwards: list[tuple[int, int]] = []
    marks = phases.Marks(HostEvent, said.append, lambda iteration, forward: forwards.append((iteration, forward)))
    phases.install(marks, training, schedules, gpt_model.GPTModel)
    monkeypatch.setattr(HostEvent, "ready", True)
    return marks, training, said, forwards


def test_an_iteration_is_marked_at_each_forward_and_said_once_its_events_completed(marked) -> None:
    marks, training, said, forwards = marked
    training.train_step(4)
    assert forwards == [(1, 1), (1, 2), (1, 3), (1, 4)]  # where --snapshot-forwards takes its snapshots
    assert said == []  # its line waits for the next iteration's start, or the exit
    HostEvent.ready = False
    training.train_step(4)  # the first iteration's events are still running: nothing said, no wait
    assert said == []
    HostEvent.ready = True
    training.train_step(2)
    assert len(said) == 2
    first = phase_lines.summary("\n".join(said), skip=0)
    assert list(first) == ["pre", "x", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "Blast", "step"]
    assert all(gpu >= 0 and host >= 0 for gpu, host in first.values())
    marks.at_exit()  # the last iteration, two micro-batches
    assert said[-1].startswith(phase_lines.PREFIX) and "F2=" in said[-1] and "F3=" not in said[-1]


def test_the_summary_takes_medians_past_the_first_lines_and_the_table_gives_differences() -> None:
    prefix = phase_lines.PREFIX
    lines = [f"{prefix} pre=1.0/1.0 F1={ms}/{ms + 5} Blast=80.0/90.0 step=50.0/50.0" for ms in (900, 800, 700, 50, 60)]
    lines.append(f"{prefix} pre=1.0/1.0 F1=70/75 Blast=80.0/90.0 step=50.0/50.0")
    rows = {"no offload": phase_lines.summary("\n".join(lines))}
    assert rows["no offload"]["F1"] == [60.0, 65.0]  # the first three lines left out
    rows["capped"] = {"pre": [1.0, 1.0], "F1": [100.0, 101.0], "Blast": [120.0, 121.0], "step": [70.0, 70.0]}
    text = phase_lines.table(rows, base="no offload")
    assert text.splitlines()[0].split()[:4] == ["pre", "F1", "Blast", "step"]
    assert "+40.0" in text.splitlines()[2] and "+20.0" in text.splitlines()[2]
    assert phase_lines.order("B10") > phase_lines.order("F10") > phase_lines.order("B9") > phase_lines.order("x")


def test_the_time_outside_train_step_is_megatrons_logged_time_less_the_phases() -> None:
    """Megatron-LM's loop synchronizes the device at each log line (its timers) outside ``train_step``: the summary
    says how long that took, from the log lines past the first iterations, at any --log-interval."""
    prefix = phase_lines.PREFIX
    phases = "\n".join(f"{prefix} pre=1.0/1.0 F1=100.0/100.0 step=200.0/200.0" for _ in range(8))

    def logged(iteration: int, ms: float) -> str:
        return f" [2026-11-29 21:00:00] iteration {iteration:8d}/      25 | elapsed time per iteration (ms): {ms} |"

    text = (
        phases
        + "\n"
        + "\n".join(logged(i, ms) for i, ms in [(1, 3000.0), (3, 900.0), (4, 350.0), (5, 360.0), (6, 340.0)])
    )
    rows = {"capped": phase_lines.summary(text)}
    said = phase_lines.outside_lines({"capped": text}, rows)
    assert said.split() == ["capped", "logged", "350.0", "ms", "an", "iteration,", "+49.0", "outside", "train_step"]
    assert phase_lines.outside_lines({"no lines": phases}, {"no lines": phase_lines.summary(phases)}) == ""


def test_the_sweep_prints_each_caps_phases_beside_no_offloads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    launchers: list[str] = []

    def run(name: str, argv: list[str], gpus: int, out: Path, env_extra: dict | None = None) -> dict:
        offload = "--offload-optimizer-states" in argv
        launchers.append(argv[argv.index("-m") + 1])
        return {
            "argv": argv, "returncode": 0, "losses": {i: 10.0 - i for i in range(1, 25)},
            "step_ms_by_iteration": dict.fromkeys(range(1, 25), 700.0 if offload else 600.0),
            "peak_allocated_GiB": 26.2 if not offload else 15.6, "peak_reserved_GiB": 26.4 if not offload else 16.2,
            "parameters": 955_000_000,
            "megatron_args": {"micro_batch_size": "2", "global_batch_size": "8", "data_parallel_size": "1"},
            "phases_ms": {"F1": [110.0 if offload else 55.0, 108.0], "step": [70.0, 70.0]},
        }  # fmt: skip

    monkeypatch.setattr(job, "run", run)
    monkeypatch.setattr(side, "preflight", lambda argv: None)
    argv = ["megatron_side_by_side.py", "--sweep", "--phases", "--out", str(tmp_path), "--caps", "50"]
    monkeypatch.setattr("sys.argv", [*argv, "--megatron-lm", str(tmp_path)])
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert side.main() == 0
    assert launchers == ["benchmarks.phases"] * 2  # no offload and the default under the cap, both marked
    text = (tmp_path / "curve.txt").read_text()
    assert "phases (benchmarks/phases.py)" in text
    assert "+55.0" in text.splitlines()[-1] and text.splitlines()[-1].startswith("cap 50%: default")
    assert curve.cell({"phases_ms": {"F1": [1.0, 2.0]}, "step_ms_by_iteration": {}}, None)["phases_ms"]


def test_the_allocator_line_gives_what_each_counter_grew_by_in_each_phase(marked) -> None:
    marks, training, said, _ = marked
    readings = iter(range(0, 10_000, 7))
    cpu = iter(range(0, 10_000, 4))  # the main thread's CPU ms grow by 4 a mark, the others' stay at 1
    marks.counters = lambda: (next(readings), 0, 3, 0.5 * len(marks.current), 2.0, next(cpu), 1.0, 0.0)  # retries: 7
    started: list[int] = []
    marks.first_iteration = lambda: started.append(marks.iterations)  # where --snapshot-oom attaches
    training.train_step(2)
    training.train_step(2)
    marks.at_exit()
    assert started == [1]  # once, as the first iteration starts (CUDA is set up by then)
    assert said[0].startswith(phase_lines.PREFIX) and said[1].startswith(phase_lines.ALLOCATOR_PREFIX)
    assert "F1=7/0/0/0.5/0/4/0/0" in said[1] and "step=7/0/0/0.5/0/4/0/0" in said[1]
    retries = phase_lines.counter_summary("\n".join(said), skip=0)
    assert retries["F1"] == [7, 0] and list(retries)[:3] == ["pre", "x", "F1"]
    host_fields = ("gc ms", "hooks ms")
    host = phase_lines.counter_summary("\n".join(said), host_fields, skip=0)
    assert host["B1"] == [0.5, 0.0]
    cpu = phase_lines.counter_summary("\n".join(said), ("main thread cpu ms", "other threads cpu ms"), skip=0)
    assert cpu["F1"] == [4.0, 0.0]
    lines = "\n".join(f"allocator and host per phase (retries/maps/unmaps/gc ms/hooks ms): F1={r}/0/0/0/{h}" for r, h in
                       ((0, 1.0), (0, 2.0), (9, 30.0)))  # fmt: skip
    assert phase_lines.counter_summary(lines, ("retries", "hooks ms"), skip=0, average=statistics.median) == {
        "F1": [0.0, 2.0]  # one slow phase moves the mean (3, 11), not the median
    }
    five = "allocator and host per phase (retries/maps/unmaps/gc ms/hooks ms): F1=2/1/0/0.25/3.5"  # an older log
    assert phase_lines.counter_summary(five, ("retries", "hooks ms"), skip=0) == {"F1": [2.0, 3.5]}


def test_options_before_the_script_combine_in_any_order() -> None:
    found, argv = phases.options(["--allocator", "--snapshot-oom", "o", "--snapshot-forwards", "12", "p", "s.py", "-x"])
    assert found == {"allocator": True, "oom": "o", "forwards": (12, "p")} and argv == ["s.py", "-x"]
    assert phases.options(["s.py", "--allocator"]) == ({}, ["s.py", "--allocator"])  # the script's own flags stay


def test_the_hooks_timed_include_what_the_gradients_finalize_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from megatron_offload.megatron import backward_prefetch, finalize_prefetch, pacing

    # Restored after the test: time_hooks replaces them for the rest of a process.
    monkeypatch.setattr(pacing.RoomForForward, "before_forward", pacing.RoomForForward.before_forward)
    monkeypatch.setattr(backward_prefetch.PrefetchDuringBackward, "on_grad_ready",
                        backward_prefetch.PrefetchDuringBackward.on_grad_ready)  # fmt: skip
    monkeypatch.setattr(finalize_prefetch, "bring_back_for_step", finalize_prefetch.bring_back_for_step)
    monkeypatch.setattr(gc, "callbacks", list(gc.callbacks))
    host_ms = {"gc": 0.0, "hooks": 0.0}
    phases.time_hooks(host_ms)
    undecided = SimpleNamespace(scheduler=SimpleNamespace(decided=False))
    # As OffloadHandle.backward_done does: the module's function, looked up at the call.
    undecided.backward_done = lambda: finalize_prefetch.bring_back_for_step(undecided)
    finalize = finalize_prefetch.PrefetchOnFinalize(lambda: "finalized", undecided)
    assert finalize() == "finalized"  # the wrapper looks the function up at each call: the timed one ran
    assert host_ms["hooks"] > 0


def test_the_runqueue_reading_is_schedstats_second_field_in_milliseconds(tmp_path: Path) -> None:
    schedstat = tmp_path / "schedstat"
    schedstat.write_text("91000000 4500000 17\n")  # on a CPU, runnable without one (ns), timeslices
    assert phase_lines.runqueue_ms(schedstat) == 4.5
    assert phase_lines.runqueue_ms(tmp_path / "missing") == 0.0  # a kernel without schedstats


def test_the_link_lines_give_each_directions_time_per_phase_and_where_it_stood_still(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from benchmarks import phase_probes
    from megatron_offload.core import stats

    monkeypatch.setattr(stats.Timings, "add", stats.Timings.add)  # install() replaces it for the process
    link = phase_probes.LinkTimeline()
    link.install()

    def at(ms: float) -> HostEvent:
        event = HostEvent()
        event.at = ms / 1e3
        return event

    timings, filed = stats.Timings(), stats.OffloadStats()
    spans = {"offload": [(100, 110), (108, 120), (130, 140)], "prefetch": [(90, 100)], "exposed": [(115, 117)]}
    for kind, pairs in spans.items():
        for start, end in pairs:
            timings.add(kind, 1, at(start), at(end))
    timings.harvest(filed)
    assert filed.offload_seconds == pytest.approx(0.032)  # still filed as before
    phases_at = [("start", 0), ("pre", 1), ("x", 2), ("F1", 40), ("Blast", 95), ("step", 125)]
    link.iteration([(phase, at(ms), 0.0, ()) for phase, ms in phases_at])
    said = link.lines()
    assert said[0].startswith(phase_probes.LINK_PREFIX)
    assert "Blast=0.0/5.0/0.0" in said[0] and "step=20.0/5.0/2.0" in said[0]  # the copies out's union, clipped
    assert said[1] == f"{phase_probes.GAPS_PREFIX} out step+25:10.0 | in "  # after 120 ms, nothing out for 10
    assert phase_probes.merged([(5, 6), (1, 3), (2, 4)]) == [(1, 4), (5, 6)]
    log = tmp_path / "row.log"
    log.write_text("\n".join(said * 4))  # the first three left out
    assert phase_probes.link_summary(log.read_text())["step"] == [20.0, 5.0]
    assert phases.main(["--summary", str(log)]) == 0


def test_link_is_an_option_before_the_script() -> None:
    assert phases.options(["--link", "--allocator", "s.py"]) == ({"link": True, "allocator": True}, ["s.py"])
