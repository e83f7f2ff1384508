"""Every touch of Megatron-LM's training loop (``megatron.training``, shipped in megatron-core wheels
from 0.17 on). Checked against megatron-core 0.19.2.

``install_training_hooks()`` makes an unmodified Megatron-LM script offload-aware by replacing four
names in megatron.training's module namespaces (no source is changed), each wrapper calling the
original:
- ``arguments.parse_args``: our flags join Megatron's parser (unless the script already added them),
  every on/off switch gets its opposite (so ``NAME: false`` in a ``--config`` file works), and a parse
  error is one line (not Megatron's usage of several hundred lines). Where Megatron-LM defines
  ``--offload-optimizer-states`` itself (its ``dev`` branch, for its own offloader), the flag runs ours
  and Megatron's stays off unless asked for by ``--chunked-optimizer-state-offload`` (config/flags.py);
  the log says which one runs;
- ``arguments.validate_args``: without a CUDA GPU, one line and exit; our checks of the flags as given run
  before Megatron's own (whose assertions would send the user the wrong way, and whose argument dump
  would bury our message), the rest after it (config/flag_checks.py); a refusal is one line, not a
  traceback (one_line.py); then a node whose host memory cannot hold what the run will pin
  (host_sizing.py) stops, before the model is built;
- ``training.get_megatron_optimizer``: the offloader is attached to the optimizer Megatron builds,
  when ``--offload-optimizer-states`` is given; with torch Adam (no TransformerEngine or apex), with
  or without offloading, megatron-core's resume bugs are worked around (``fix_torch_adam_checkpoints``);
- ``training.print_rank_last``: the per-iteration log line gains the offload figures (on the rank
  that prints it, Megatron's last rank; the figures are that rank's own).
What the wrappers attach and read back is one ``TrainingRun`` (training_run.py), made by the
install and kept on ``megatron.training.training``, which is also what keeps a second install from
wrapping the wrappers.
With ``--offload-weights``, weights_training.py replaces three more names of ``megatron.training.training``
(``setup_model_and_optimizer``, ``get_megatron_optimizer`` before the wrapper above, ``report_memory``).
``--offload-gpu-memory-cap-gib`` caps the process's GPU memory right after argument validation,
with or without ``--offload-optimizer-states``. Unless ``PYTORCH_CUDA_ALLOC_CONF`` is set, the caching
allocator's expandable segments are turned on (said in the log; see gpu_memory.py for why).
Without ``--offload-optimizer-states`` nothing else behaves differently, with one exception that fixes a
crash of the wheels themselves: megatron-core wheels ship the dataset helpers prebuilt
(``helpers_cpp``) but not the Makefile that Megatron's start-up ``compile_helpers()`` runs, so every
run from a wheel exits there. When the prebuilt module imports, that compile step is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_offload.config.files import NO_CUDA, add_switch_inverses, missing_training_message
from megatron_offload.config.flag_checks import check_offload_combinations, ignored_offload_flags, validate_offload_args
from megatron_offload.config.flags import (
    add_offload_args,
    config_from_args,
    has_offload_args,
    offload_requested,
    which_offloader,
)
from megatron_offload.config.long_context_flags import layer_input_bytes_per_rank, long_context_config_from_args
from megatron_offload.config.weight_flags import FLAG, ignored_weight_flags, weight_config_from_args
from megatron_offload.core.gpu_memory import apply_memory_cap, gpu_only, use_expandable_segments_by_default
from megatron_offload.core.host_memory import HostMemoryError, check_host_room
from megatron_offload.megatron.adam_resume import fix_torch_adam_checkpoints
from megatron_offload.megatron.host_sizing import host_bytes_per_rank, wants_host_memory
from megatron_offload.megatron.long_context_adapter import CHUNKED_LOSS_NEEDS, supports_output_processor
from megatron_offload.megatron.long_context_training import attach_long_context, layer_input_log_fields
from megatron_offload.megatron.long_context_training import describe as describe_long_context
from megatron_offload.megatron.one_line import one_line_errors, print_once, refuse_bad_flags, stop
from megatron_offload.megatron.optimizer_adapter import OffloadHandle, attach_offloader
from megatron_offload.megatron.report import MemoryReading, format_offload_fields
from megatron_offload.megatron.sleep_hooks import install_rl_sleep_hooks
from megatron_offload.megatron.training_run import RUN_ATTR, TrainingRun, current_run
from megatron_offload.megatron.weights_training import install_weight_hooks

__all__ = ["MissingMegatronTraining", "attached_handles", "install_training_hooks", "parsed_megatron_args"]


class MissingMegatronTraining(ImportError):
    """megatron.training is not installed (megatron-core wheels before 0.17 lack it)."""


def attached_handles() -> list[OffloadHandle]:
    """The offloaders attached by the hooks in this process (one per optimizer Megatron built)."""
    run = current_run()
    return [] if run is None else list(run.offloads)


def _import_megatron_training() -> tuple[Any, Any, Any]:
    try:
        from megatron.training import arguments, global_vars, training
    except ImportError as error:
        raise MissingMegatronTraining(missing_training_message()) from error
    return arguments, global_vars, training


def parsed_megatron_args() -> argparse.Namespace | None:
    """Megatron's parsed arguments, or None before they exist (or without megatron.training)."""
    try:
        from megatron.training import global_vars

        return global_vars.get_args()
    except (ImportError, AssertionError):
        return None


def _skip_compile_when_prebuilt() -> None:
    from megatron.core.datasets import utils as dataset_utils

    compile_helpers = dataset_utils.compile_helpers

    def compile_helpers_unless_prebuilt() -> None:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            compile_helpers()

    dataset_utils.compile_helpers = compile_helpers_unless_prebuilt


def install_training_hooks() -> None:
    """Hook megatron.training so scripts get the offload flags, checks, attachment and log figures. The
    wrappers share one ``TrainingRun``, made here and kept on ``training`` (a second call finds it)."""
    arguments, global_vars, training = _import_megatron_training()
    if getattr(training, RUN_ATTR, None) is not None:
        return
    run = TrainingRun()

    parse_args = arguments.parse_args

    def parse_args_with_offload_flags(extra_args_provider: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
        def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            if not has_offload_args(parser):
                parser = add_offload_args(parser)
            one_line_errors(parser)
            return add_switch_inverses(parser)

        return parse_args(provider, *args, **kwargs)

    validate_args = arguments.validate_args

    def validate_args_then_offload_flags(args: argparse.Namespace, *rest: Any, **kwargs: Any) -> Any:
        if not torch.cuda.is_available():  # Megatron would assert so only after its argument dump
            stop(NO_CUDA)
        refuse_bad_flags(check_offload_combinations, args)  # before Megatron's assertions and dump
        result = validate_args(args, *rest, **kwargs)
        refuse_bad_flags(validate_offload_args, args)
        run.weights.config = weight_config_from_args(args)  # read once; the hooks below go by it
        run.long_context_config = long_context_config_from_args(args)
        if run.long_context_config.chunked_loss and not supports_output_processor():  # before the model is built
            stop(f"megatron-offload: {CHUNKED_LOSS_NEEDS}")
        which = which_offloader(args)
        if which:
            print_once(which)
        for ignored, needed in (
            (ignored_offload_flags(args), "--offload-optimizer-states"),
            (ignored_weight_flags(args), FLAG),
        ):
            if ignored:
                verb = "has" if len(ignored) == 1 else "have"
                print_once(f"megatron-offload: {', '.join(ignored)} {verb} no effect without {needed}")
        if wants_host_memory(args) and getattr(args, "offload_host_memory_check", True):
            needed = (host_bytes_per_rank(args) or 0) + layer_input_bytes_per_rank(args)
            if needed:  # before the model is built: a node that cannot hold the state stops here, in one line
                try:
                    check_host_room(needed)
                except HostMemoryError as error:
                    stop(f"megatron-offload: {error}")
        cap = config_from_args(args).gpu_memory_cap_gib
        if cap is not None:  # before the model is built, so that everything counts against it
            run.gpu_memory_cap_bytes = apply_memory_cap(cap, int(os.environ.get("LOCAL_RANK", "0")))
            print_once(f"megatron-offload: GPU memory capped at {cap:g} GiB per process (--offload-gpu-memory-cap-gib)")
        return result

    # Before the optimizer getter is captured below:
    install_weight_hooks(training, lambda: global_vars.get_args(), run.weights, lambda: run.gpu_memory_cap_bytes)
    get_megatron_optimizer = training.get_megatron_optimizer

    def get_megatron_optimizer_and_attach(*args: Any, **kwargs: Any) -> Any:
        optimizer = get_megatron_optimizer(*args, **kwargs)
        model_chunks = args[1] if len(args) > 1 else kwargs["model_chunks"]
        long_context = attach_long_context(model_chunks, run.long_context_config)
        if long_context is not None:
            run.long_context.append(long_context)
            print_once(describe_long_context(long_context))
        fix_note = fix_torch_adam_checkpoints(optimizer)  # with or without offloading
        if fix_note:
            print_once(fix_note)
        megatron_args = global_vars.get_args()
        if offload_requested(megatron_args):
            try:
                handle = attach_offloader(optimizer, config_from_args(megatron_args))
            except HostMemoryError as error:  # the host, not the code: one line (attach undid itself)
                stop(f"megatron-offload: {error}")
            handle.say = print_once  # what `--offload-fraction auto` chose, on the first rank
            run.offloads.append(handle)
            if run.weights.config.streamed_step:  # after the offloader: its step is streamed
                chunks = args[1] if len(args) > 1 else kwargs["model_chunks"]
                run.weights.stream_step(optimizer, chunks if isinstance(chunks, list) else [chunks], handle)
        return optimizer

    print_rank_last = training.print_rank_last

    def print_rank_last_with_offload(message: Any) -> None:
        iteration_line = isinstance(message, str) and " iteration " in message and "consumed samples" in message
        if iteration_line:  # the figures per iteration: a line covers --log-interval iterations, or since a resume
            start = int(getattr(global_vars.get_args(), "iteration", 0) or 0)
            steps = run.iterations_since_last_line(message, start)
        if run.offloads and iteration_line:
            for handle in run.offloads:
                current = handle.read_stats()
                before = run.logged.get(id(handle), type(current)())
                memory = MemoryReading(  # GPU memory only: host-mapped weights are not counted
                    gpu_only(torch.cuda.memory_allocated(), allocated=True),
                    gpu_only(torch.cuda.memory_reserved()),
                    gpu_only(current.peak_allocated_bytes, allocated=True),
                    gpu_only(current.peak_reserved_bytes),
                )
                message += format_offload_fields(current, before, memory)
                message += run.weights.log_fields(steps)
                run.logged[id(handle)] = dataclasses.replace(current)
        if run.long_context and iteration_line:
            for handle in run.long_context:
                before = run.logged.get(id(handle))
                fields, run.logged[id(handle)] = layer_input_log_fields(handle, before, steps)
                message += fields
        print_rank_last(message)

    allocator_note = use_expandable_segments_by_default()
    if allocator_note:
        print_once(allocator_note)
    _skip_compile_when_prebuilt()
    arguments.parse_args = parse_args_with_offload_flags
    arguments.validate_args = validate_args_then_offload_flags
    training.get_megatron_optimizer = get_megatron_optimizer_and_attach
    install_rl_sleep_hooks()  # wraps the optimizer getter above: RL's offload_to_cpu goes through our sleep
    training.print_rank_last = print_rank_last_with_offload
    setattr(training, RUN_ATTR, run)  # installed: the guard above
