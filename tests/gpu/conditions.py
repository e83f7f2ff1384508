"""GPT training under conditions that hold for a whole process, run in a process of its own by
test_conditions.py: a GPU memory cap, and ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (read when CUDA starts).

    python -m tests.gpu.conditions cap      # the cap: no offload must fail, every policy must fit
    python -m tests.gpu.conditions fraction # a cap of the no-offload peak less half the state: auto keeps some
    CUDA_DEVICE_MAX_CONNECTIONS=1 python -m tests.gpu.conditions parity

The allocator keeps its defaults (no PYTORCH_CUDA_ALLOC_CONF), as for a user of the library API who
comes through no launcher of ours. Prints one JSON line: what each run measured, for the test to judge.
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from megatron_offload import attach_offloader
from megatron_offload.core.units import SAVING_SHARE, cap_below_peak
from tests.gpu.harness import GPTShape, build_gpt_training, init_distributed, state_bytes

# Activations of a micro-batch (~1.5 GiB) well above the state (~0.9 GiB), as in pretraining.
SHAPE = GPTShape(
    num_layers=4,
    hidden_size=1024,
    ffn_hidden_size=4096,
    num_attention_heads=8,
    vocab_size=8192,
    seq_length=1024,
    micro_batch_size=4,
    num_micro_batches=2,
)
STEPS = 6
GIB = 1024**3


def train(prefetch: str | None, **config: object) -> dict:
    """Train STEPS iterations (the loss read after every step, as Megatron-LM does); what it measured."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        training = build_gpt_training(SHAPE)
        state = state_bytes(training)
        handle = attach_offloader(training.optimizer, prefetch=prefetch, **config) if prefetch else None
        losses = [training.train_step(iteration)[0] for iteration in range(STEPS)]
        params = torch.cat([p.detach().flatten().float() for p in training.model[0].parameters()]).cpu()
        stats = handle.read_stats() if handle is not None else None
        if handle is not None:
            handle.detach()
    except torch.OutOfMemoryError as error:
        return {"error": f"out of memory: {str(error).splitlines()[0][:200]}"}
    return {
        "losses": losses,
        "params": params,
        "state_bytes": state,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "kept_bytes": stats.kept_bytes if stats else None,
        "host_bytes": stats.host_bytes if stats else None,
        "hook_waits": stats.hook_waits if stats else None,
    }


def judged(run: dict, baseline: dict) -> dict:
    """A run's figures, with whether it matched the baseline bit for bit."""
    if "error" in run:
        return run
    params = run.pop("params")
    return run | {
        "losses_equal": run["losses"] == baseline["losses"],
        "params_equal": torch.equal(params, baseline["params"]),
    }


def main() -> None:
    mode = sys.argv[1]
    init_distributed()
    baseline = train(None)
    result: dict = {"mode": mode, "device": torch.cuda.get_device_name()}
    if mode in ("cap", "fraction"):
        share = SAVING_SHARE if mode == "cap" else 0.5  # of the state the cap takes off the no-offload peak
        cap = int(cap_below_peak(baseline["peak_allocated"], baseline["state_bytes"], share))
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
        result |= {"cap": cap, "baseline_peak_allocated": baseline["peak_allocated"]}
        result["baseline_peak_reserved"] = baseline["peak_reserved"]
        result["no_offload_under_cap"] = train(None).get("error", "ran")
    if mode == "fraction":
        result["runs"] = {"fraction auto": judged(train("auto", fraction="auto"), baseline)}
    else:
        result["runs"] = {policy: judged(train(policy), baseline) for policy in ("auto", "finalize", "step")}
    result["baseline_losses"] = baseline["losses"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
