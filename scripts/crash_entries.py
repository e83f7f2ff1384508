"""The crash entries of scripts/integration.py: a run with offloading killed with SIGKILL at a chosen
moment (tests/gpu/crash_driver.py), then a new process that loads the last complete checkpoint and
runs on; both compared with an uninterrupted run of the same flags.

Per entry (``crash-after-step``, ``crash-backward``, ``crash-checkpoint``), checks: the kill happened
where asked (after-step: with copies to host still pending); ``latest_checkpointed_iteration.txt`` names
the last save before the kill, and a save cut short by the kill (crash-checkpoint) is left without its
``.metadata``; the resumed run says it loaded that iteration; its grad norms (and its losses, but for
the first after the load: Megatron's own accounting differs there with or without offloading) equal
the uninterrupted run's as printed; and every tensor of both final checkpoints (parameters and Adam
state, converted with ``dcp_to_torch_save``) is bitwise equal.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CRASH_DRIVER = "tests/gpu/crash_driver.py"
CRASH_MARKER = "megatron-offload crash drill: SIGKILL"
TRAIN_ITERS, SAVE_INTERVAL = 20, 5
KILL_AT = {"after-step": 13, "backward": 13, "checkpoint": 15}  # the iteration of each kill
ARGS = [
    *("--config", "configs/tiny.yaml", "--train-iters", str(TRAIN_ITERS), "--log-memory-interval", str(TRAIN_ITERS)),
    *("--offload-optimizer-states", "--ckpt-format", "torch_dist", "--save-interval", str(SAVE_INTERVAL)),
]
_STEP = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
_scratch: Path | None = None
_reference: dict[str, Any] = {}  # the uninterrupted run, shared by the entries of one invocation


def losses_and_grad_norms(text: str) -> dict[int, tuple[str, str]]:
    """Per iteration, the loss and grad norm exactly as Megatron printed them."""
    return {int(m[1]): (m[2], m[3]) for m in _STEP.finditer(text)}


def last_complete_iteration(save_dir: Path) -> int | None:
    """What Megatron will load: the tracker file is written only after a save is complete."""
    tracker = save_dir / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text().strip()) if tracker.exists() else None


def cut_short(save_dir: Path) -> list[str]:
    """Iteration directories without the ``.metadata`` a finished torch_dist save writes last."""
    return sorted(p.name for p in save_dir.glob("iter_*") if p.is_dir() and not (p / ".metadata").exists())


def checkpoint_tensors(iteration_dir: Path, scratch: Path) -> dict[str, Any]:
    """Every item of a torch_dist checkpoint, by flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{iteration_dir.parent.name}-{iteration_dir.name}.pt"
    dcp_to_torch_save(iteration_dir, target)
    return flatten(torch.load(target, weights_only=False))


def flatten(item: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(item, dict):
        return {k: v for key, value in item.items() for k, v in flatten(value, f"{prefix}{key}/").items()}
    if isinstance(item, list | tuple):
        return {k: v for i, value in enumerate(item) for k, v in flatten(value, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): item}


def compare_checkpoints(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, list[str]]:
    """Tensors compared, and every difference (a key on one side only, dtype, shape, any bit)."""
    differences = [f"{key}: only in one checkpoint" for key in sorted(a.keys() ^ b.keys())]
    compared = 0
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            compared += 1
            same = x.dtype == y.dtype and x.shape == y.shape
            # Bitwise, not numerically: NaNs of the same bits are equal, -0.0 and 0.0 are not.
            if not same or not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)):
                differences.append(f"{key}: differs ({x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)})")
        elif isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            differences.append(f"{key}: a tensor in one checkpoint only")
    return compared, differences


def run_entry(entry: Any, run: Callable[..., dict], out: Path) -> tuple[dict[str, dict], list[str], dict]:
    """Uninterrupted (once per invocation), killed, resumed: their results, failures and what was seen."""
    global _scratch
    _scratch = _scratch or Path(tempfile.mkdtemp(prefix="offload-crash-"))
    mode, kill_at = entry.crash, KILL_AT[entry.crash]
    if not _reference:
        reference_dir = _scratch / "uninterrupted"
        result = run(entry, "uninterrupted", [CRASH_DRIVER, *ARGS, "--save", str(reference_dir)], out)
        _reference.update(result=result, dir=reference_dir, log=(out / f"{entry.name}-uninterrupted.log").read_text())
    save_dir = _scratch / mode
    entry.env.update(OFFLOAD_CRASH_AT=mode, OFFLOAD_CRASH_ITERATION=str(kill_at))
    results = {"uninterrupted": _reference["result"]}
    results["killed"] = run(entry, "killed", [CRASH_DRIVER, *ARGS, "--save", str(save_dir)], out)
    facts = {"tracker_after_kill": last_complete_iteration(save_dir), "cut_short_after_kill": cut_short(save_dir)}
    entry.env.pop("OFFLOAD_CRASH_AT")
    results["resumed"] = run(
        entry, "resumed", [CRASH_DRIVER, *ARGS, "--save", str(save_dir), "--load", str(save_dir)], out
    )
    logs = {name: (out / f"{entry.name}-{name}.log").read_text() for name in ("killed", "resumed")}
    logs["uninterrupted"] = _reference["log"]
    failures = check(mode, kill_at, results, logs, facts)
    if not failures:
        final = f"iter_{TRAIN_ITERS:07d}"
        a = checkpoint_tensors(_reference["dir"] / final, _scratch)
        b = checkpoint_tensors(save_dir / final, _scratch)
        facts["tensors_compared"], differences = compare_checkpoints(a, b)
        failures += [f"final checkpoints: {d}" for d in differences[:20]]
        if not facts["tensors_compared"]:
            failures.append("final checkpoints: no tensors found to compare")
    return results, failures, facts


def check(mode: str, kill_at: int, results: dict, logs: dict[str, str], facts: dict) -> list[str]:
    """Failures of a crash entry before its checkpoints are compared, as sentences."""
    failures = [
        f"{n} exited {results[n]['returncode']}" for n in ("uninterrupted", "resumed") if results[n]["returncode"]
    ]
    marker = next((line for line in logs["killed"].splitlines() if CRASH_MARKER in line), None)
    facts["kill"] = marker
    expected = (kill_at - 1) // SAVE_INTERVAL * SAVE_INTERVAL  # the last save before the kill
    if marker is None or results["killed"]["returncode"] == 0:
        failures.append(f"killed: no SIGKILL at {mode} of iteration {kill_at} (exit {results['killed']['returncode']})")
    elif mode == "after-step" and int(re.search(r"pending copy-out bytes (\d+)", marker)[1]) <= 0:
        failures.append("killed: no copy to host was in flight at the kill")
    if facts["tracker_after_kill"] != expected:
        failures.append(
            f"after the kill the tracker names iteration {facts['tracker_after_kill']}, expected {expected}"
        )
    if mode == "checkpoint" and facts["cut_short_after_kill"] != [f"iter_{kill_at:07d}"]:
        failures.append(f"the save cut short is not left incomplete: {facts['cut_short_after_kill']}")
    if not re.search(rf"successfully loaded checkpoint from .* at iteration {expected}\b", logs["resumed"]):
        failures.append(f"resumed: no 'successfully loaded checkpoint ... at iteration {expected}' in the log")
    reference, resumed = losses_and_grad_norms(logs["uninterrupted"]), losses_and_grad_norms(logs["resumed"])
    wanted = list(range(expected + 1, TRAIN_ITERS + 1))
    if sorted(resumed) != wanted:
        failures.append(f"resumed: logged iterations {sorted(resumed)}, expected {wanted}")
    for i in wanted:
        if i in resumed and resumed[i][1] != reference.get(i, (None, None))[1]:
            failures.append(f"iteration {i}: grad norm {resumed[i][1]} resumed, {reference.get(i)} uninterrupted")
        if i in resumed and i > expected + 1 and resumed[i][0] != reference.get(i, (None, None))[0]:
            failures.append(f"iteration {i}: loss {resumed[i][0]} resumed, {reference.get(i)} uninterrupted")
    first = expected + 1
    facts["first_loss_after_load"] = [resumed.get(first, ("?",))[0], reference.get(first, ("?",))[0]]
    return failures
