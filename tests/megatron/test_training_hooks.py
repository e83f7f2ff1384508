"""The hooks on Megatron-LM's training loop, against a stand-in for ``megatron.training`` (megatron-core
wheels before 0.17 lack it, and it needs CUDA to train): the order of the checks and their messages,
one line each, before Megatron's own assertions and its argument dump."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_offload import run
from megatron_offload.config.files import NO_CUDA, expand_config_argv
from megatron_offload.config.weight_flags import WeightConfig
from megatron_offload.core.units import GIB
from megatron_offload.megatron import host_sizing
from megatron_offload.megatron import training_hooks as megatron_training
from megatron_offload.megatron.training_run import RUN_ATTR, TrainingRun, current_run
from megatron_offload.megatron.weights_training import StreamedWeights
from megatron_offload.weights.stats import WeightStats

MEGATRON_DUMP = "------------------------ arguments ------------------------"


def fake_megatron_training() -> types.ModuleType:
    """megatron.training's arguments, global_vars and training modules, reduced to what the hooks wrap;
    validate_args asserts and prints as Megatron's does."""
    arguments = types.ModuleType("megatron.training.arguments")

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
        for flag in ("--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--use-distributed-optimizer"):
            parser.add_argument(flag, action="store_true")
        parser.add_argument("--optimizer", default="adam")
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser.parse_args()

    def validate_args(args, defaults={}):  # noqa: B006 (Megatron's signature)
        if args.optimizer_cpu_offload:
            assert args.use_precision_aware_optimizer, "The optimizer cpu offload must be used in conjunction..."
        print(MEGATRON_DUMP)
        # configs/tiny.yaml's model as validation leaves it: no padded_vocab_size (the tokenizer sets it later)
        vars(args).update(num_layers=4, hidden_size=512, data_parallel_size=1, vocab_size=32000)
        args.make_vocab_size_divisible_by = 128
        return args

    arguments.parse_args, arguments.validate_args = parse_args, validate_args
    training = types.ModuleType("megatron.training.training")
    training.get_megatron_optimizer = lambda *a, **k: None
    training.print_rank_last = print
    package = types.ModuleType("megatron.training")
    package.arguments, package.training = arguments, training
    package.global_vars = types.ModuleType("megatron.training.global_vars")
    return package


@pytest.fixture
def megatron(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The stand-in installed and hooked; everything the hooks change is put back afterwards."""
    from megatron.core.datasets import utils as dataset_utils

    package = fake_megatron_training()
    for name in ("arguments", "training", "global_vars"):
        monkeypatch.setitem(sys.modules, f"megatron.training.{name}", getattr(package, name))
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setattr(dataset_utils, "compile_helpers", dataset_utils.compile_helpers)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("RANK", raising=False)
    megatron_training.install_training_hooks()
    return package


def parse_and_validate(megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, *argv: str) -> object:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return megatron.arguments.validate_args(megatron.arguments.parse_args())


def test_our_refusal_comes_before_megatrons_assertion_and_dump(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ("--offload-optimizer-states", "--optimizer-cpu-offload", "--use-distributed-optimizer")
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, *argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and MEGATRON_DUMP not in out
    (line,) = err.splitlines()
    assert line.startswith(
        "megatron-offload: --offload-optimizer-states cannot be combined with --optimizer-cpu-offload."
    )


def test_no_cuda_is_one_line_before_megatrons_dump(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        parse_and_validate(megatron, monkeypatch, "--use-distributed-optimizer")
    out, err = capsys.readouterr()
    assert err == NO_CUDA + "\n" and MEGATRON_DUMP not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--offload-fraction", "most"],
            "pretrain_gpt.py: error: argument --offload-fraction: expected 'auto' or a number from 0 to 1, "
            "got 'most' (--help lists the flags)",
        ),
        (["--offload-fraction", "2"], "megatron-offload: --offload-fraction must be 'auto' or a number from 0"),
        (["--offload-chunk-mb", "0"], "megatron-offload: --offload-chunk-mb must be a positive number of MiB"),
        (["--no-such-flag"], "pretrain_gpt.py: error: unrecognized arguments: --no-such-flag (--help lists the flags)"),
    ],
)
def test_bad_values_are_one_line_even_with_offloading_off(
    megatron: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, *argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and MEGATRON_DUMP not in out
    (line,) = err.splitlines()
    assert line.startswith(message)


def test_a_config_file_turns_megatron_switches_off_and_ignored_flags_are_named(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = tmp_path / "run.yaml"
    config.write_text("use-distributed-optimizer: false\noffload-fraction: 0.5\n")
    args = parse_and_validate(megatron, monkeypatch, *expand_config_argv(["--config", str(config)]))
    assert args.use_distributed_optimizer is False and args.offload_fraction == 0.5
    out = capsys.readouterr().out
    assert "megatron-offload: --offload-fraction has no effect without --offload-optimizer-states\n" in out
    assert MEGATRON_DUMP in out  # a working combination: Megatron's validation ran


def test_the_launcher_stops_without_cuda_before_running_the_script(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    monkeypatch.setattr(run, "install_training_hooks", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main([str(script), "--lr", "1"]) == 2
    assert capsys.readouterr().err == NO_CUDA + "\n"


def test_the_launcher_names_a_bad_config_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    (tmp_path / "bad.yaml").write_text("lr: [1\n")
    assert run.main([str(script), "--config", str(tmp_path / "bad.yaml")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"megatron-offload: --config {tmp_path / 'bad.yaml'}: not valid YAML at line 2")


def test_the_launcher_help_lists_the_offload_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Run an unmodified Megatron-LM training script")
    for flag in ("--offload-prefetch {auto,finalize,step}", "--offload-chunk-mb MIB", "--offload-fraction {auto,F}"):
        assert flag in out
    assert "--offload-gpu-memory-cap-gib GIB" in out and "--no-offload-host-memory-check" in out


def test_a_node_without_room_for_the_state_stops_in_one_line_before_the_model_is_built(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_offload.core import host_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_sizing, "state_bytes_per_rank", lambda args: 40 * 2**30)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 16 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, "--offload-optimizer-states", "--use-distributed-optimizer")
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert line.startswith("megatron-offload: --offload-optimizer-states needs 40.00 GiB of host memory per rank x 2")
    assert "--no-offload-host-memory-check" in line
    capsys.readouterr()
    parse_and_validate(  # the check turned off: no refusal
        megatron,
        monkeypatch,
        "--offload-optimizer-states",
        "--use-distributed-optimizer",
        "--no-offload-host-memory-check",
    )


def test_the_state_on_a_rank_is_counted_from_megatrons_own_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    estimate = types.ModuleType("megatron.training.theoretical_memory_usage")
    estimate.compute_weight_and_optimizer_memory = lambda args: 1e9 * (6 + 12 / args.data_parallel_size)
    monkeypatch.setitem(sys.modules, "megatron.training.theoretical_memory_usage", estimate)
    args = argparse.Namespace(data_parallel_size=2, offload_master_weights=True)
    assert host_sizing.state_bytes_per_rank(args) == 6 * 10**9  # 1e9 params x 12 bytes / 2 ranks
    args.offload_master_weights = False
    assert host_sizing.state_bytes_per_rank(args) == 4 * 10**9
    assert host_sizing.state_bytes_per_rank(argparse.Namespace()) is None  # cannot count: no check here


def megatrons_count(args: argparse.Namespace) -> float:
    """As megatron.training.theoretical_memory_usage counts (0.19.2): it reads ``padded_vocab_size``,
    which Megatron sets only when it builds the tokenizer, after argument validation."""
    embedding = args.hidden_size * args.padded_vocab_size
    return (12 * args.hidden_size**2 * args.num_layers + embedding) * (6 + 12 / args.data_parallel_size)


def test_the_state_is_counted_before_the_tokenizer_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    estimate = types.ModuleType("megatron.training.theoretical_memory_usage")
    estimate.compute_weight_and_optimizer_memory = megatrons_count
    monkeypatch.setitem(sys.modules, "megatron.training.theoretical_memory_usage", estimate)
    args = argparse.Namespace(  # configs/tiny.yaml as validation leaves it: no padded_vocab_size yet
        num_layers=4, hidden_size=512, data_parallel_size=1, vocab_size=32000, make_vocab_size_divisible_by=128
    )
    params = 12 * 512**2 * 4 + 512 * 32000  # 32000 is a multiple of 128 already
    assert host_sizing.state_bytes_per_rank(args) == 12 * params
    assert not hasattr(args, "padded_vocab_size")  # counted on a copy: Megatron still pads it itself
    args.vocab_size = 32001
    assert host_sizing.state_bytes_per_rank(args) == 12 * (params + 512 * 128)  # padded to 32128
    del args.vocab_size  # a tokenizer's files will tell: the transformer layers alone, a lower bound
    assert host_sizing.state_bytes_per_rank(args) == 12 * 12 * 512**2 * 4


def test_a_node_too_small_is_refused_in_validation_before_the_tokenizer_exists(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPU drill's node-too-small case on the CPU: Megatron's count as it reads the arguments (no
    padded vocabulary yet), the node's memory shared as if by 4096 ranks: one line, in validation."""
    from megatron_offload.core import host_memory

    estimate = types.ModuleType("megatron.training.theoretical_memory_usage")
    estimate.compute_weight_and_optimizer_memory = megatrons_count
    monkeypatch.setitem(sys.modules, "megatron.training.theoretical_memory_usage", estimate)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory, "ranks_on_this_node", lambda: 4096)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 100 * 2**30)
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, "--offload-optimizer-states", "--use-distributed-optimizer")
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert line.startswith("megatron-offload: --offload-optimizer-states needs 0.32 GiB of host memory per rank x 4096")


@pytest.mark.parametrize(
    ("yaml_line", "problem"),
    [
        ("use-distributed-optimizer: 3", "--use-distributed-optimizer is an on/off switch: give true or false, not 3"),
        ("offload-chunk-mb: big", "expected a number of MiB, such as 64 (the default), got 'big'"),
        ("offload-chunk-mb: true", "needs a value; true and false are for on/off switches"),
    ],
)
def test_a_bad_value_in_a_config_file_names_the_file_and_the_key(
    megatron: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    yaml_line: str,
    problem: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = tmp_path / "run.yaml"
    config.write_text(f"{yaml_line}\n")
    key = yaml_line.split(":")[0]
    # In Megatron's own parser (our script, or the launcher's run of a script) ...
    with pytest.raises(SystemExit):
        parse_and_validate(megatron, monkeypatch, *expand_config_argv(["--config", str(config)]))
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"megatron-offload: --config {config}, key {key}: {problem}"
    # ... and in the launcher's check, before any script runs.
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    assert run.main([str(script), "--config", str(config)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"megatron-offload: --config {config}, key {key}: {problem}"


def test_the_same_flag_on_the_command_line_is_named_as_argparse_names_it(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = tmp_path / "run.yaml"
    config.write_text("offload-chunk-mb: 32\n")
    with pytest.raises(SystemExit):
        argv = expand_config_argv(["--config", str(config), "--offload-gpu-memory-cap-gib", "abc"])
        parse_and_validate(megatron, monkeypatch, *argv)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "pretrain_gpt.py: error: argument --offload-gpu-memory-cap-gib: expected a number of GiB, the GPU memory "
        "to imitate, such as 20, got 'abc' (--help lists the flags)"
    )


def test_a_host_that_refuses_the_state_at_attach_is_one_line(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the estimate in validation could not count the model, the engine's exact check at attach
    refuses: the same one line, not a traceback."""
    from megatron_offload import HostMemoryError

    def refuse(*args: object, **kwargs: object) -> None:
        raise HostMemoryError("--offload-optimizer-states needs 9.00 GiB of host memory per rank x 8 rank(s)")

    monkeypatch.setattr(megatron_training, "attach_offloader", refuse)
    monkeypatch.setattr(megatron_training, "fix_torch_adam_checkpoints", lambda optimizer: None)
    megatron.global_vars.get_args = lambda: argparse.Namespace(offload_optimizer_states=True)
    with pytest.raises(SystemExit) as exit_:
        megatron.training.get_megatron_optimizer(None, [])
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and line.startswith("megatron-offload: --offload-optimizer-states needs 9.00 GiB")


def test_the_hooks_keep_one_run_on_the_module_they_hook_and_install_once(megatron: types.ModuleType) -> None:
    run = current_run()
    assert run is getattr(megatron.training, RUN_ATTR) and run == TrainingRun()
    wrapped = (megatron.arguments.parse_args, megatron.training.get_megatron_optimizer)
    megatron_training.install_training_hooks()  # a second call finds the run: nothing wrapped twice
    assert (megatron.arguments.parse_args, megatron.training.get_megatron_optimizer) == wrapped
    assert current_run() is run


def test_an_attached_offloader_is_the_runs(megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    handle = types.SimpleNamespace(say=None)
    monkeypatch.setattr(megatron_training, "attach_offloader", lambda optimizer, config: handle)
    monkeypatch.setattr(megatron_training, "fix_torch_adam_checkpoints", lambda optimizer: None)
    megatron.global_vars.get_args = lambda: argparse.Namespace(offload_optimizer_states=True)
    megatron.training.get_megatron_optimizer(None, [])
    assert current_run().offloads == [handle] and megatron_training.attached_handles() == [handle]


def test_streamed_weights_log_what_moved_since_the_last_line() -> None:
    stats = WeightStats(bytes_in=4 * GIB, bytes_out=2 * GIB, exposed_ms=10.0)
    weights = StreamedWeights(handles=[types.SimpleNamespace(read_stats=lambda: stats)])
    assert " weights in/out per iter (GiB): 2.00/1.00 | weights exposed (ms): 5.0 |" in weights.log_fields(2)
    stats = WeightStats(bytes_in=5 * GIB, bytes_out=3 * GIB, exposed_ms=11.0)
    assert " weights in/out per iter (GiB): 1.00/1.00 | weights exposed (ms): 1.0 |" in weights.log_fields(1)


def line(iteration: int) -> str:
    """Megatron-LM's iteration log line, as ``training_log`` writes it."""
    return f" [2026-11-25 15:40:08] iteration {iteration:>8}/      10 | consumed samples: {8 * iteration:>12} |"


def test_a_log_line_covers_the_iterations_since_the_line_before() -> None:
    run = TrainingRun()
    # --log-interval 5 from iteration 0: the weights' and layer inputs' figures are divided by 5, not summed.
    assert [run.iterations_since_last_line(line(i), start=0) for i in (5, 10)] == [5, 5]
    resumed = TrainingRun()  # resumed from a checkpoint at iteration 7: its first line covers 8, 9 and 10
    assert [resumed.iterations_since_last_line(line(i), start=7) for i in (10, 15)] == [3, 5]
    assert TrainingRun().iterations_since_last_line("no iteration named here", start=0) == 1


def test_the_cap_validation_applies_is_the_runs_for_the_weights_build(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    applied: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(megatron_training, "apply_memory_cap", lambda cap, device: applied.append((cap, device)) or 7)
    assert current_run().gpu_memory_cap_bytes is None
    parse_and_validate(megatron, monkeypatch, "--offload-gpu-memory-cap-gib", "20")
    assert applied == [(20.0, 0)] and current_run().gpu_memory_cap_bytes == 7
    assert "megatron-offload: GPU memory capped at 20 GiB per process" in capsys.readouterr().out


def test_chunked_loss_on_a_megatron_core_without_output_processor_is_refused_in_validation(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the model is built, in one line (the version probe is stood in: the CPU venv's megatron-core
    may be either side of 0.19)."""
    from megatron_offload.megatron import long_context_adapter

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron_training, "supports_output_processor", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        parse_and_validate(megatron, monkeypatch, "--chunked-loss")
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert line == f"megatron-offload: {long_context_adapter.CHUNKED_LOSS_NEEDS}"


def test_the_weight_step_mode_is_read_once_in_validation_and_passed_down(
    megatron: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parse_and_validate(megatron, monkeypatch, "--offload-weights-step", "megatron")
    assert current_run().weights.config == WeightConfig(enabled=False, step="megatron")

    handle, streamed = types.SimpleNamespace(say=None), []
    monkeypatch.setattr(megatron_training, "attach_offloader", lambda optimizer, config: handle)
    monkeypatch.setattr(megatron_training, "fix_torch_adam_checkpoints", lambda optimizer: None)
    monkeypatch.setattr(current_run().weights, "stream_step", lambda *args: streamed.append(args))
    # Megatron's args after validation no longer decide: the config read there does.
    megatron.global_vars.get_args = lambda: argparse.Namespace(offload_optimizer_states=True, offload_weights=True)
    megatron.training.get_megatron_optimizer(None, ["model"])
    assert streamed == []  # the config says weights are not streamed
    current_run().weights.config = WeightConfig(enabled=True)
    megatron.training.get_megatron_optimizer(None, ["model"])
    assert streamed == [(None, ["model"], handle)]


def test_a_weight_config_refuses_an_unknown_step() -> None:
    assert WeightConfig(enabled=True).streamed_step and not WeightConfig(enabled=True, step="megatron").streamed_step
    with pytest.raises(ValueError, match="--offload-weights-step must be one of streamed, megatron"):
        WeightConfig(step="fast")
