"""The launcher, --config files and the log-line figures, without a GPU."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_offload import OffloadStats
from megatron_offload.config.files import expand_config_argv
from megatron_offload.megatron.report import MemoryReading, format_offload_fields
from megatron_offload.run import main as run_main

ROOT = Path(__file__).resolve().parents[1]
HAS_MEGATRON_TRAINING = importlib.util.find_spec("megatron.training") is not None


def test_config_file_flags_come_before_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "model.yaml"
    config.write_text("num_layers: 4\nbf16: true\noffload-master-weights: false\neval_iters: [1, 2]\n")
    argv = ["--lr", "1e-4", "--config", str(config), "--num-layers", "8"]
    assert expand_config_argv(argv) == [
        "--num-layers=4", "--bf16", "--no-offload-master-weights", "--eval-iters", "1", "2",
        "--lr", "1e-4", "--num-layers", "8",
    ]  # fmt: skip
    assert expand_config_argv([f"--config={config}"])[:1] == ["--num-layers=4"]
    assert expand_config_argv(["--lr", "1"]) == ["--lr", "1"]


@pytest.mark.parametrize(
    "text, message", [("- a\n- b\n", "expected a mapping"), ("lr:\n", "has no value"), ("a: {b: 1}\n", "mapping")]
)
def test_bad_config_files_are_named(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
        expand_config_argv(["--config", str(config)])
    with pytest.raises(FileNotFoundError, match="no such file"):
        expand_config_argv(["--config", str(tmp_path / "missing.yaml")])


def test_shipped_configs_expand() -> None:
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs, "configs/ holds no YAML files"
    for config in configs:
        flags = expand_config_argv(["--config", str(config)])
        assert flags and all(flag.startswith("--") for flag in flags[:1])


def test_log_fields_average_over_the_interval() -> None:
    before = OffloadStats(offloads=10, offload_seconds=1.0, prefetch_seconds=2.0, exposed_seconds=0.5)
    now = OffloadStats(
        offloads=12,
        offload_seconds=1.2,
        prefetch_seconds=2.3,
        exposed_seconds=0.6,
        host_bytes=3 * 1024**3,
        allocator_retries=3,
        bytes_streamed=3 * 1024**3,
    )
    fields = format_offload_fields(now, before, MemoryReading(1024**3, 2 * 1024**3, 5 * 1024**3, 6 * 1024**3))
    assert "offloaded per rank (GiB): 3.00 |" in fields
    assert "offload copy out/in (ms): 100.0/150.0 |" in fields
    assert "offload exposed (ms): 50.0 |" in fields
    assert "allocator retries: 3 |" in fields  # since the line before, not averaged
    assert "offload streamed in step (GiB): 1.50 |" in fields  # per step
    assert "mem allocated/reserved (GiB): 1.00/2.00 |" in fields
    assert "mem peak allocated/reserved (GiB): 5.00/6.00 |" in fields
    from benchmarks.memory_report import parse_log

    step = parse_log(f" [2026-11-23] iteration        5/      20 | lm loss: 1.0E+01 |{fields}").steps[5]
    assert (step.peak_allocated_gib, step.peak_reserved_gib, step.offloaded_gib) == (5.0, 6.0, 3.0)
    assert step.allocator_retries == 3 and step.streamed_gib == 1.5


def test_launcher_usage_and_missing_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main([]) == 2
    assert "usage: python -m megatron_offload.run SCRIPT" in capsys.readouterr().err
    assert run_main(["--help"]) == 0
    assert "--offload-optimizer-states" in capsys.readouterr().out
    assert run_main(["no/such/script.py"]) == 2
    assert "no such script" in capsys.readouterr().err


@pytest.mark.skipif(HAS_MEGATRON_TRAINING, reason="megatron.training is installed here; the GPU tests run it")
def test_launcher_explains_missing_megatron_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # without a GPU, that is said first
    assert run_main([str(script)]) == 2
    err = capsys.readouterr().err
    assert "megatron.training" in err and "0.17" in err and "attach_offloader" in err


@pytest.mark.skipif(HAS_MEGATRON_TRAINING, reason="megatron.training is installed here; the GPU tests run it")
def test_pretrain_script_explains_missing_megatron_training() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/pretrain_gpt.py", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode != 0
    assert "0.17" in result.stderr + result.stdout


def test_integration_reads_losses_memory_and_offload_figures_from_megatron_logs() -> None:
    from tests.drills import integration, integration_checks

    logs = ROOT / "tests" / "data" / "memory_logs"
    baseline = integration_checks.parse_log((logs / "baseline.log").read_text())
    offload = integration_checks.parse_log((logs / "step.log").read_text())
    assert baseline["losses"] and baseline["losses"] == offload["losses"]
    assert baseline["offloaded_GiB_per_rank"] is None and offload["offloaded_GiB_per_rank"] > 0
    assert offload["max_allocated_MiB"] < baseline["max_allocated_MiB"]
    entry = integration.Entry("nightly-fixture", 1, {"baseline": [], "offload": []})
    results = {"baseline": baseline | {"returncode": 0}, "offload": offload | {"returncode": 0}}
    assert integration_checks.check(entry, results) == []
    table = integration_checks.render_table({entry.name: {"gpus": 1, "failures": [], "runs": results}})
    assert "nightly-fixture" in table and table.rstrip().endswith("ok")
    # 732,257,280 parameters x 12 bytes = 8.18 GiB, as the offload run's log line says
    assert abs(offload["expected_state_GiB"] - 8.18) < 0.01
    lost = results | {"offload": results["offload"] | {"offloaded_GiB_per_rank": 6.0}}
    (failure,) = integration_checks.check(entry, lost)
    assert failure == "offload: 6.0 GiB offloaded per rank, expected 8.18 (12 B/param)"
    # A capped entry: its offload run gets the baseline's peak less 90% of the state, and must stay under it.
    cap = integration_checks.cap_from(baseline)
    assert cap == baseline["max_allocated_MiB"] / 1024 - 0.9 * baseline["expected_state_GiB"]
    over = results | {"offload": results["offload"] | {"cap_GiB": cap, "max_reserved_MiB": cap * 1024 + 1}}
    (failure,) = integration_checks.check(entry, over)
    assert failure.startswith("offload: peak reserved") and "above the" in failure


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], False),
        (["--data-parallel-size", "8"], False),
        (["--tensor-model-parallel-size", "2"], True),
        (["--tensor-model-parallel-size=2"], True),
        (["--context-parallel-size", "2"], True),
        (["--tensor-model-parallel-size", "2", "--tensor-model-parallel-size", "1"], False),  # the last wins
        (["--config", "configs/gpt_tp2.yaml"], True),
        (["--config", "configs/gpt_tp2.yaml", "--tensor-model-parallel-size", "1"], False),
        (["--config", "configs/tiny.yaml"], False),
    ],
)
def test_one_connection_only_for_tensor_or_context_parallelism(argv: list[str], expected: bool) -> None:
    from megatron_offload.config.files import needs_one_connection

    assert needs_one_connection([arg.replace("configs/", f"{ROOT}/configs/") for arg in argv]) is expected


def test_train_sh_asks_for_one_connection_only_where_megatron_requires_it() -> None:
    script = (ROOT / "scripts" / "train.sh").read_text()
    assert "needs_one_connection" in script
    assert 'GPUS:-1}" -gt 1 ] && export CUDA_DEVICE_MAX_CONNECTIONS' not in script


def test_expandable_segments_unless_the_user_configured_the_allocator() -> None:
    from megatron_offload.core.gpu_memory import use_expandable_segments_by_default

    environ: dict[str, str] = {}
    note = use_expandable_segments_by_default(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and "PYTORCH_CUDA_ALLOC_CONF" in note
    for user in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, {"PYTORCH_ALLOC_CONF": "x:y"}):
        environ = dict(user)
        assert use_expandable_segments_by_default(environ) is None and environ == user
