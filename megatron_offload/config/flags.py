"""Command-line flags for Megatron-style scripts, and reading them into an ``OffloadConfig``. Which of their
combinations with Megatron's own flags are refused is flag_checks.py's.

``add_offload_args`` has the signature Megatron-LM expects of ``pretrain(extra_args_provider=...)``.

Megatron-LM's ``dev`` branch defines ``--offload-optimizer-states`` itself, as a deprecated alias of its
``--chunked-optimizer-state-offload`` (``store_true``, dest ``offload_optimizer_states``, which
``get_megatron_optimizer_config`` copies into ``OptimizerConfig`` to switch its own offloader on). On such
a parser ``add_offload_args`` takes the option string over: ours parses it into ``OWN_DEST`` and
Megatron's dest keeps its default, False, so that one flag never switches on two offloaders. Megatron's
offloader is then asked for by its own flag, ``--chunked-optimizer-state-offload``. ``offload_requested``
reads the switch either way, and ``which_offloader`` words the log line saying which of the two runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_offload.config.long_context_flags import add_long_context_args
from megatron_offload.config.options import AUTO, OffloadConfig, PrefetchPolicy, SettingError
from megatron_offload.config.weight_flags import add_weight_args

__all__ = [
    "DEFAULTS",
    "GROUP_TITLE",
    "OWN_DEST",
    "UPSTREAM_FLAG",
    "add_offload_args",
    "config_from_args",
    "has_offload_args",
    "offload_fraction",
    "offload_requested",
    "upstream_defines_the_flag",
    "which_offloader",
]

DEFAULTS = OffloadConfig()  # the flags' defaults are the config's, stated once
FLAG = "--offload-optimizer-states"
GROUP_TITLE = "optimizer state offloading (megatron-offload)"
OWN_DEST = "megatron_offload_optimizer_states"
"""Where ``--offload-optimizer-states`` lands on a parser whose Megatron-LM defines the flag too."""
UPSTREAM_FLAG = "--chunked-optimizer-state-offload"
"""Megatron-LM's own offloader (its ``dev`` branch), of which it makes our flag's name an alias."""
SETTING_FLAGS = {
    "offload_master_weights": "--offload-master-weights",
    "prefetch": "--offload-prefetch",
    "chunk_mb": "--offload-chunk-mb",
    "fraction": "--offload-fraction",
    "check_host_memory": "--offload-host-memory-check",
    "gpu_memory_cap_gib": "--offload-gpu-memory-cap-gib",
}
"""The flag of each OffloadConfig field, for messages worded as the command line gives them."""


def has_offload_args(parser: argparse.ArgumentParser) -> bool:
    """Whether ``add_offload_args`` already ran on ``parser``."""
    return any(group.title == GROUP_TITLE for group in parser._action_groups)


def offload_requested(args: argparse.Namespace) -> bool:
    """Whether ``--offload-optimizer-states`` asked for megatron-offload's offloader."""
    if hasattr(args, OWN_DEST):  # Megatron-LM defines the flag too: its dest is Megatron's, not ours
        return bool(getattr(args, OWN_DEST))
    return bool(getattr(args, "offload_optimizer_states", False))


def upstream_defines_the_flag(args: argparse.Namespace) -> bool:
    """Whether the parser behind ``args`` was one whose Megatron-LM defines ``--offload-optimizer-states``."""
    return hasattr(args, OWN_DEST)


def which_offloader(args: argparse.Namespace) -> str | None:
    """The log line naming the offloader that runs, where Megatron-LM defines --offload-optimizer-states
    too (so that a reader of the log knows which of the two the flag switched on); None elsewhere."""
    if not upstream_defines_the_flag(args):
        return None
    if offload_requested(args):
        return (
            "megatron-offload: --offload-optimizer-states runs megatron-offload's offloader; Megatron-LM's own "
            f"(which this Megatron-LM also names --offload-optimizer-states) stays off: {UPSTREAM_FLAG} asks for it"
        )
    if getattr(args, "chunked_optimizer_state_offload", False):
        return f"megatron-offload: {UPSTREAM_FLAG} runs Megatron-LM's own offloader; megatron-offload's is off"
    return None


def _take_over_upstream_flag(parser: argparse.ArgumentParser) -> bool:
    """Remove Megatron-LM's ``--offload-optimizer-states`` from ``parser``, keeping its dest at False (its
    validation and OptimizerConfig read it); True if there was one. argparse's own conflict resolution
    (``conflict_handler="resolve"``) does the removal, on this one option string only."""
    upstream = parser._option_string_actions.get(FLAG)
    if upstream is None:
        return False
    parser._handle_conflict_resolve(upstream, [(FLAG, upstream)])
    parser.set_defaults(**{upstream.dest: False})
    return True


def offload_fraction(text: str) -> float | str:
    """argparse type of --offload-fraction: 'auto' or a number (its range is checked with the other
    values, so that the flag, a --config file and the Python API give the same message)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number from 0 to 1, got {text!r}") from None


def _number_of(what: str) -> Callable[[str], float]:
    """argparse type of a number flag whose refusal says what to give (its range is checked with the other
    values, as for --offload-fraction)."""

    def number(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    return number


def add_offload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the offload flags to ``parser`` and return it (unchanged if it has them already). Where
    Megatron-LM defines ``--offload-optimizer-states`` too, ours replaces it (see the module's note)."""
    if has_offload_args(parser):
        return parser
    taken_over = _take_over_upstream_flag(parser)
    group = parser.add_argument_group(GROUP_TITLE)
    group.add_argument(
        FLAG,
        action="store_true",
        dest=OWN_DEST if taken_over else "offload_optimizer_states",
        help="Keep Adam's exp_avg, exp_avg_sq (and the fp32 master weights) in pinned host memory "
        "between optimizer steps; Adam still runs on the GPU. Needs --use-distributed-optimizer."
        + (
            " This Megatron-LM names its own offloader so too; here the flag runs megatron-offload's, and "
            f"Megatron-LM's is {UPSTREAM_FLAG}."
            if taken_over
            else ""
        ),
    )
    group.add_argument(
        "--offload-master-weights",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.offload_master_weights,
        help="Offload the fp32 master weights too (default). --no-offload-master-weights keeps them on "
        "the GPU: 4 bytes per parameter shard stay resident, and a third less is copied each way.",
    )
    group.add_argument(
        "--offload-prefetch",
        choices=[policy.value for policy in PrefetchPolicy],
        default=DEFAULTS.prefetch.value,
        help="When the state that moves comes back to the GPU. 'auto' (default): during the last "
        "micro-batch's backward, into memory backward has freed, and the rest streams through the optimizer "
        "step. 'finalize': all of it once backward is done. 'step': the smallest footprint: none of the "
        "state stays on the GPU and none comes back ahead; the step streams it all through three chunks.",
    )
    group.add_argument(
        "--offload-chunk-mb",
        type=_number_of("a number of MiB, such as 64 (the default)"),
        default=DEFAULTS.chunk_mb,
        metavar="MIB",
        help="Size of the pieces the state moves in (default 64). The streamed optimizer step holds three "
        "of them on the GPU; a parameter larger than this moves as one piece.",
    )
    group.add_argument(
        "--offload-fraction",
        type=offload_fraction,
        default=DEFAULTS.fraction,
        metavar="{auto,F}",
        help="'auto' (default): keep on the GPU all the optimizer state that fits under the memory limit "
        "(--offload-gpu-memory-cap-gib, else the GPU's memory) beside what training needs without it, "
        "measured in iteration 1, and move only the rest: with room to spare nothing moves. A number F: "
        "offload at least this share (0 to 1); the run stops in one line if the rest does not fit.",
    )
    group.add_argument(
        "--offload-gpu-memory-cap-gib",
        type=_number_of("a number of GiB, the GPU memory to imitate, such as 20"),
        default=DEFAULTS.gpu_memory_cap_gib,
        metavar="GIB",
        help="Let this process use at most this much GPU memory, as if the GPU were that small "
        "(torch.cuda.set_per_process_memory_fraction, set before the model is built). Works with or "
        "without --offload-optimizer-states: the way to ask 'would this fit on a smaller GPU?'.",
    )
    group.add_argument(
        "--offload-host-memory-check",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.check_host_memory,
        help="Check at start that host memory can hold every rank's offloaded state (default on).",
    )
    add_weight_args(group)
    add_long_context_args(group)
    return parser


def config_from_args(args: argparse.Namespace) -> OffloadConfig:
    """The OffloadConfig the flags describe (call flag_checks.py's ``validate_offload_args`` first); a value
    out of range is a ValueError naming its flag."""
    try:
        return OffloadConfig(
            # Streamed weights build the fp32 masters in host memory already: nothing to move.
            offload_master_weights=getattr(args, "offload_master_weights", DEFAULTS.offload_master_weights)
            and not getattr(args, "offload_weights", False),
            prefetch=getattr(args, "offload_prefetch", DEFAULTS.prefetch),
            chunk_mb=getattr(args, "offload_chunk_mb", DEFAULTS.chunk_mb),
            fraction=getattr(args, "offload_fraction", DEFAULTS.fraction),
            check_host_memory=getattr(args, "offload_host_memory_check", DEFAULTS.check_host_memory),
            gpu_memory_cap_gib=getattr(args, "offload_gpu_memory_cap_gib", DEFAULTS.gpu_memory_cap_gib),
        )
    except SettingError as error:
        raise ValueError(error.named(SETTING_FLAGS.get(error.field, error.field))) from None
