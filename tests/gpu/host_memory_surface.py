"""What the host-memory drills (host_memory_drill.py) read of a training and how they provoke the host: a case run
and timed, two snapshots compared (``tests/gpu/parity.py`` takes them), what attaching changes on the optimizer and
model, a refused pin, and the process's address space capped."""

from __future__ import annotations

import contextlib
import resource
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "address_space_capped",
    "case",
    "differing",
    "left_behind",
    "refuse_pinning",
    "surface",
]


def refuse_pinning(data_ptr: int, nbytes: int) -> int:
    return 2  # cudaErrorMemoryAllocation


@contextlib.contextmanager
def address_space_capped(margin: int) -> Iterator[None]:
    """The host refuses any allocation beyond ``margin`` bytes more than this process maps now: the soft
    RLIMIT_AS, restored on the way out (before an error propagates further)."""
    vm_kib = next(
        int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmSize")
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_kib * 1024 + margin, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def case(function: Callable[[], tuple[list[str], str, dict]]) -> dict[str, Any]:
    """Run one case: its failures, message and facts, timed; an unexpected exception is a failure."""
    start = time.monotonic()
    try:
        failures, message, intact = function()
    except Exception as error:  # the drill goes on with the next case, saying where this one broke
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
        failures, message, intact = [f"the drill itself raised {type(error).__name__} at {where}: {error}"], "", {}
    return {
        "passed": not failures,
        "failures": failures,
        "message": message,
        "intact": intact,
        "seconds": round(time.monotonic() - start, 1),
    }


def differing(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    import torch

    if expected.keys() != actual.keys():
        return sorted(expected.keys() ^ actual.keys())
    return [key for key in expected if not torch.equal(expected[key], actual[key])]


def surface(training: Any) -> dict[str, Any]:
    """What attaching changes, read without the library: instance attributes (callables by identity) of
    the optimizers and model configs, and the hooks on the model's modules and parameters."""
    from megatron_offload.megatron.optimizer_adapter import distributed_optimizers

    dist_opts = distributed_optimizers(training.optimizer)
    objects = {"optimizer": training.optimizer, "model config": training.config}
    objects |= {f"distributed optimizer {i}": d for i, d in enumerate(dist_opts)}
    objects |= {f"inner optimizer {i}": d.optimizer for i, d in enumerate(dist_opts)}
    seen = {name: {k: id(v) if callable(v) else "value" for k, v in vars(obj).items()} for name, obj in objects.items()}
    modules = [m for chunk in training.model for m in chunk.modules()]
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    seen["module hooks"] = {kind: sum(len(getattr(m, kind, {}) or {}) for m in modules) for kind in kinds}
    params = [p for chunk in training.model for p in chunk.parameters()]
    seen["parameter hooks"] = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params)
    return seen


def left_behind(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What a failed attach left changed, one phrase each."""
    changes = []
    for name in before:
        if before[name] == after[name]:
            continue
        if not isinstance(before[name], dict) or name == "module hooks":  # counts
            changes.append(f"{name}: {before[name]} -> {after[name]}")
            continue
        for key in sorted(before[name].keys() | after[name].keys()):
            if before[name].get(key) != after[name].get(key):
                changes.append(f"{name}.{key} {'added' if key not in before[name] else 'replaced'}")
    return changes
