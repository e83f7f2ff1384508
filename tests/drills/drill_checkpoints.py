"""What the drills read from a Megatron run: its logged losses and grad norms, its checkpoint directory
(the tracker, complete and cut-short saves) and, tensor by tensor, a torch_dist (DCP) checkpoint.

A checkpoint is read as fingerprints: per tensor its dtype, shape and a SHA-256 of its bytes. Two
fingerprints are equal exactly when the tensors are bitwise equal (NaNs of the same bits are equal, -0.0
and 0.0 are not), and a fingerprint is a short string: four checkpoints of an entry (offloaded and plain,
uninterrupted and resumed) are compared without holding any of them in memory.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

_STEP = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
ABSENT = "absent"  # the fingerprint of a key one checkpoint lacks


def losses_and_grad_norms(text: str) -> dict[int, tuple[str, str]]:
    """Per iteration, the loss and grad norm exactly as Megatron printed them."""
    return {int(m[1]): (m[2], m[3]) for m in _STEP.finditer(text)}


def last_complete_iteration(save_dir: Path) -> int | None:
    """What Megatron will load: the tracker file is written only after a save is complete."""
    tracker = save_dir / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text().strip()) if tracker.exists() else None


def is_complete(iteration_dir: Path) -> bool:
    """A torch_dist save writes ``.metadata`` last (after every shard): its presence marks a whole save."""
    return (iteration_dir / ".metadata").is_file()


def cut_short(save_dir: Path) -> list[str]:
    """Iteration directories without the ``.metadata`` a finished torch_dist save writes last."""
    return sorted(p.name for p in save_dir.glob("iter_*") if p.is_dir() and not is_complete(p))


def flatten(item: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(item, dict):
        return {k: v for key, value in item.items() for k, v in flatten(value, f"{prefix}{key}/").items()}
    if isinstance(item, list | tuple):
        return {k: v for i, value in enumerate(item) for k, v in flatten(value, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): item}


def fingerprint(tensor: Any) -> str:
    """``dtype shape sha256:...`` of a tensor's bytes: equal exactly when two tensors are bitwise equal."""
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:24]
    return f"{str(data.dtype).removeprefix('torch.')} {tuple(tensor.shape)} sha256:{digest}"


def fingerprints(iteration_dir: Path, scratch: Path) -> dict[str, str]:
    """Every tensor of a torch_dist checkpoint, by flattened key, as its fingerprint."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{iteration_dir.parent.name}-{iteration_dir.name}.pt"
    dcp_to_torch_save(iteration_dir, target)
    try:
        items = flatten(torch.load(target, weights_only=False))
    finally:
        target.unlink(missing_ok=True)  # 400 MB a checkpoint of tiny.yaml: fingerprints are all we keep
    return {key: fingerprint(value) for key, value in items.items() if isinstance(value, torch.Tensor)}


def tensor_differences(a: dict[str, str], b: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Every key whose tensor differs (or is on one side only): key -> (fingerprint in a, in b)."""
    keys = sorted(a.keys() | b.keys())
    return {key: (a.get(key, ABSENT), b.get(key, ABSENT)) for key in keys if a.get(key) != b.get(key)}
