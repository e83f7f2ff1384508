"""scripts/pretrain_gpt.py (Megatron-LM's own loop, with offloading), killed with SIGKILL at a chosen
moment: the crash entries of tests/drills/integration.py run it, then resume from what it saved.

    OFFLOAD_CRASH_AT=after-step|backward|checkpoint OFFLOAD_CRASH_ITERATION=13 \\
        torchrun --standalone --nproc-per-node 1 tests/gpu/crash_driver.py --config configs/tiny.yaml ...

- ``after-step``: right after the optimizer step of that iteration returns; with offloading, while its
  copies to host are still in flight (the pending GPU bytes are printed, and must be > 0);
- ``backward``: inside the backward of that iteration; with offloading, in the backward pacer's
  ``handle.prefetch``, after it started copies of state back to the GPU; without (the control run of a
  crash entry), in a hook on the model's output tensor, which autograd runs as backward starts;
- ``checkpoint``: while the checkpoint saved after that iteration is being written, after the first
  file of it was written and before its metadata and ``latest_checkpointed_iteration.txt``.
Each kill point has a Megatron-level form that needs no offloader (the optimizer's step, a hook on the
model, the checkpoint writer), so the same kill can be made in a run without offloading: the control
that tells megatron-core's own resume differences from ours (tests/drills/crash_verdict.py). Without
``OFFLOAD_CRASH_AT`` it is pretrain_gpt.py unchanged. Every wrap is made here, on instances and on
Megatron's classes, never in library code. Before the kill one line starting with ``CRASH_MARKER`` says
where it happened and through which hook.
"""

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The script as users run it, its functions kept: running it expands --config in sys.argv (and makes this
# checkout's megatron_offload importable where it is not installed).
PRETRAIN_GPT = runpy.run_path(str(ROOT / "scripts" / "pretrain_gpt.py"))

import torch  # noqa: E402
from megatron.training import training  # noqa: E402

from megatron_offload.megatron.training_hooks import attached_handles, install_training_hooks  # noqa: E402

CRASH_MARKER = "megatron-offload crash drill: SIGKILL"
MODE = os.environ.get("OFFLOAD_CRASH_AT")
ITERATION = int(os.environ.get("OFFLOAD_CRASH_ITERATION", "0"))
TRAINING_PID = os.getpid()
steps_done = 0  # optimizer steps taken in this process (it starts from iteration 0: no --load)


def kill(where: str) -> None:
    """Say where, then SIGKILL the training process (and this one, if a save runs in a helper)."""
    print(f"{CRASH_MARKER} {where} (mode {MODE}, iteration {ITERATION})", flush=True)
    sys.stderr.flush()
    os.kill(TRAINING_PID, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def method(handle: Any, new: str, old: str) -> Any:
    """The handle's method under its new name, or under today's (the lead's rewrite renames them)."""
    return getattr(handle, new, None) or getattr(handle, old)


def in_backward() -> bool:
    """True inside autograd's backward (where the pacer's gradient hooks run)."""
    return torch._C._current_graph_task_id() != -1


def wrap_optimizer(optimizer: Any) -> None:
    step = optimizer.step

    def step_then_maybe_kill(*args: Any, **kwargs: Any) -> Any:
        global steps_done
        result = step(*args, **kwargs)
        steps_done += 1
        if MODE == "after-step" and steps_done == ITERATION:
            handles = attached_handles()
            if not handles:
                kill(f"after the step of iteration {steps_done} (no offloader attached: the optimizer's step)")
            pending = sum(method(h, "pending_offload_bytes", "pending_out_bytes")() for h in handles)
            kill(f"after the step of iteration {steps_done}, pending copy-out bytes {pending}")
        return result

    optimizer.step = step_then_maybe_kill


def wrap_prefetch(owner: Any) -> None:
    """Wrap ``owner.prefetch``: the handle's (the pacer calls it after the lead's rewrite) and each
    offloader's (today's pacer calls those); the first call inside backward that started copies kills."""
    prefetch = owner.prefetch

    def prefetch_then_maybe_kill(*args: Any, **kwargs: Any) -> Any:
        started = prefetch(*args, **kwargs)
        if MODE == "backward" and steps_done + 1 == ITERATION and started and in_backward():
            kill(f"inside the backward of iteration {steps_done + 1}, after prefetch started {started} bytes")
        return started

    owner.prefetch = prefetch_then_maybe_kill


def hook_model_backward(model_chunks: list[Any]) -> None:
    """The backward kill point without an offloader: a hook on each model chunk's output tensor, run by
    autograd as the backward of that output starts (the first micro-batch's backward of the iteration)."""

    def kill_in_backward(grad: Any) -> Any:
        if steps_done + 1 == ITERATION and in_backward():
            kill(f"inside the backward of iteration {steps_done + 1} (no offloader attached: a hook on the model)")
        return grad

    def on_output(module: Any, inputs: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(kill_in_backward)

    for chunk in model_chunks:
        chunk.register_forward_hook(on_output)


def wrap_checkpoint_writer() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data

    def write_then_maybe_kill(*args: Any, **kwargs: Any) -> Any:
        result = write(*args, **kwargs)
        if MODE == "checkpoint" and steps_done == ITERATION:
            written = kwargs["write_bucket"][0] if "write_bucket" in kwargs else "one file"
            kill(f"while saving the checkpoint of iteration {steps_done}, after writing {written}")
        return result

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_then_maybe_kill)


def main() -> None:
    if MODE not in (None, "after-step", "backward", "checkpoint") or (MODE and ITERATION < 1):
        sys.exit(f"crash_driver.py: OFFLOAD_CRASH_AT={MODE!r}, OFFLOAD_CRASH_ITERATION={ITERATION}: not a drill")
    install_training_hooks()  # ours first, so that the wrap below sees the offloader attached
    get_optimizer = training.get_megatron_optimizer

    def get_optimizer_and_arm(*args: Any, **kwargs: Any) -> Any:
        optimizer = get_optimizer(*args, **kwargs)
        if MODE is not None:
            wrap_optimizer(optimizer)
            for handle in attached_handles():
                for owner in [handle, *handle.offloaders]:
                    wrap_prefetch(owner)
            if MODE == "backward" and not attached_handles():
                hook_model_backward(kwargs["model_chunks"] if "model_chunks" in kwargs else args[1])
        return optimizer

    training.get_megatron_optimizer = get_optimizer_and_arm
    if MODE == "checkpoint":
        wrap_checkpoint_writer()
    PRETRAIN_GPT["main"]()
    if MODE is not None:
        print(f"megatron-offload crash drill: iteration {ITERATION} never reached the {MODE} kill", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
