"""A run out of GPU memory ends in one line: what it asked for, what it held, the cap, where in the iteration,
and the flags that would move more off the GPU, from the flags it ran with."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import torch

from megatron_offload.megatron.out_of_memory import out_of_memory_line, raised_in, what_to_add

GIB = 1 << 30
ERROR = "CUDA out of memory. Tried to allocate 192.00 GiB. GPU 0 has a total capacity of 139.80 GiB"


def megatron(**flags: object) -> argparse.Namespace:
    defaults = {"seq_length": 2048, "micro_batch_size": 1, "transformer_impl": "local", "spec": None}
    return argparse.Namespace(**{**defaults, **flags})


def streamed(**flags: object) -> argparse.Namespace:
    """A run with the optimizer state and the weights offloaded (full recompute), and ``flags``."""
    return megatron(offload_optimizer_states=True, offload_weights=True, recompute_granularity="full", **flags)


def test_long_context_with_weights_streamed_is_told_the_long_context_pieces() -> None:
    args = streamed(seq_length=65536, offload_gpu_memory_cap_gib=24.0)
    line = out_of_memory_line(RuntimeError(ERROR), args, int(20.5 * GIB), GIB)
    assert line.startswith("megatron-offload: out of GPU memory under --offload-gpu-memory-cap-gib 24: asked for ")
    assert "192.00 GiB with 20.50 GiB reserved at the peak" in line
    assert "sdpa_spec" in line and "--offload-layer-inputs" in line and "--chunked-loss" in line
    assert "--offload-weights" not in line and "\n" not in line


def test_short_sequences_are_told_the_state_then_the_weights() -> None:
    assert what_to_add(megatron()) == [
        "--offload-optimizer-states",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    ]
    state = megatron(offload_optimizer_states=True, recompute_granularity="full")
    assert what_to_add(state) == ["--offload-weights (with full recompute one layer at a time)"]


def test_everything_on_says_so() -> None:
    args = streamed(
        seq_length=65536,
        spec=["megatron_offload.megatron.sdpa_spec", "gpt_layer_spec"],
        offload_layer_inputs=True,
        chunked_loss=True,
    )
    assert what_to_add(args) == []
    assert "Every offload this run can use is on" in out_of_memory_line(RuntimeError("x"), args, 0, GIB)


def test_state_kept_on_the_gpu_is_told_the_smallest_footprint_first() -> None:
    args = streamed(seq_length=4096, offload_gpu_memory_cap_gib=16.0, offload_prefetch="auto")
    line = out_of_memory_line(RuntimeError(ERROR), args, int(15.97 * GIB), GIB, kept_bytes=int(8.06 * GIB))
    assert "To move more off the GPU, add: --offload-prefetch step (8.06 GiB of optimizer state was kept" in line
    assert "Every offload this run can use is on" not in line
    # Where nothing was kept, or the smallest footprint ran already, that is not the advice.
    assert what_to_add(args) == []
    assert what_to_add(megatron(**{**vars(args), "offload_prefetch": "step"}), kept_gib=8.06) == []


def test_the_launcher_prints_the_line_instead_of_a_traceback(tmp_path) -> None:
    """A script that runs out of memory through the launcher (no GPU needed: the error is raised as such)."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(
        textwrap.dedent(f"""
        import logging, torch
        logging.basicConfig()
        timer = logging.getLogger("megatron.core.utils")  # megatron-core's straggler timer repeats errors so
        timer.warning("a slow rank")
        try:
            raise torch.OutOfMemoryError({ERROR!r})
        except torch.OutOfMemoryError as error:
            timer.warning(f"{{error}}\\n['Traceback (most recent call last):']")
            raise
    """)
    )
    runner = textwrap.dedent(f"""
        import sys, torch
        import megatron_offload.run as run
        torch.cuda.is_available = lambda: True
        torch.cuda.max_memory_reserved = lambda *a: 3 << 30
        run.install_training_hooks = lambda: None
        sys.exit(run.main([{str(script)!r}]))
    """)
    result = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "a slow rank" in result.stderr  # megatron-core's other warnings stay
    assert result.stderr.count("CUDA out of memory") == 0
    assert "megatron-offload: out of GPU memory on this GPU: asked for 192.00 GiB with 3.00 GiB" in result.stderr


def test_the_smallest_footprint_out_of_memory_says_what_training_needs_without_the_state(monkeypatch) -> None:
    """The whole state in host memory and still out of memory: the measured numbers, the limit, and
    --offload-weights, in one line."""
    import torch

    from megatron_offload import OptimizerStateOffloader
    from megatron_offload.config.options import OffloadConfig
    from megatron_offload.core import gpu_memory
    from megatron_offload.megatron import out_of_memory, training_hooks
    from megatron_offload.megatron.optimizer_adapter import OffloadHandle
    from megatron_offload.optimizer_state.scheduler import StateScheduler

    masters = [torch.nn.Parameter(torch.randn(1000)) for _ in range(4)]
    offloader = OptimizerStateOffloader(
        torch.optim.AdamW(masters), masters, chunk_bytes=4096, pin_memory=False, check_host_memory=False
    )
    offloader.offload()
    handle = OffloadHandle(object(), OffloadConfig(gpu_memory_cap_gib=16))
    handle.offloaders, handle.decision.scheduler = [offloader], StateScheduler(lambda: 16 * GIB)
    args = megatron(offload_optimizer_states=True, recompute_granularity="full", offload_gpu_memory_cap_gib=16.0)
    monkeypatch.setattr(training_hooks, "attached_handles", lambda: [handle])
    monkeypatch.setattr(training_hooks, "parsed_megatron_args", lambda: args)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: int(15.5 * GIB))
    # Host-mapped memory left by earlier GPU tests in this process is not GPU memory: none here.
    monkeypatch.setattr(gpu_memory, "mapped_bytes", lambda: 0)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.25 GiB. GPU 0 has a total capacity")
    line = out_of_memory.line_for(error)
    state = offloader.plan.full_bytes() / GIB
    assert line == (
        "megatron-offload: out of GPU memory under --offload-gpu-memory-cap-gib 16: even with all "
        f"{state:.2f} GiB of optimizer state in host memory, training needs at least 16.75 GiB without it "
        "(15.50 GiB reserved at the peak + 1.25 GiB asked) and the memory limit is 16.00 GiB. To move more off "
        "the GPU, add: --offload-weights (with full recompute one layer at a time)"
    )
    offloader.keep_bytes(offloader.plan.full_bytes())  # state kept on the GPU: keeping less would help
    assert handle.smallest_footprint_note(int(15.5 * GIB), GIB) is None


class PumpRunsOutOfMemory:
    """A handle whose copies run out of memory as soon as a hook of the real pacing classes pumps them."""

    quiet = idle = False  # copies under way: every hook pumps

    def pump(self) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB.")


def raised(run) -> BaseException:
    try:
        run()
    except torch.OutOfMemoryError as error:
        return error
    raise AssertionError("no out-of-memory error")


def test_the_line_says_where_in_the_iteration_memory_ran_out() -> None:
    """Where in an iteration, from the frames the error passed through: a forward or a backward, and whether in
    the hooks that move optimizer state (the real ones, on a CPU model), or the optimizer's step (the real
    OffloadHandle wrapper); nothing where no frame tells."""
    from megatron.core.pipeline_parallel.schedules import custom_backward

    from megatron_offload.config.options import OffloadConfig
    from megatron_offload.megatron.backward_prefetch import PrefetchDuringBackward
    from megatron_offload.megatron.offload_handle import OffloadHandle
    from megatron_offload.megatron.pacing import RoomForForward

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inputs = torch.randn(2, 4)
    leaving = RoomForForward(PumpRunsOutOfMemory(), [model])
    leaving.on_gpu = True
    error = raised(lambda: model(inputs))
    assert raised_in(error, iteration=3) == "in a forward of iteration 3, while optimizer state left"
    leaving.remove()
    loss = model(inputs).sum()
    coming = PrefetchDuringBackward(PumpRunsOutOfMemory(), [model], lambda: True)
    coming.on_gpu = True
    assert raised_in(raised(loss.backward)) == "in a backward, while optimizer state came back"
    coming.remove()

    class Kernel(torch.autograd.Function):  # a backward kernel's allocation
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB.")

    loss = Kernel.apply(model(inputs)).sum()
    assert raised_in(raised(loss.backward)) == "in a backward"
    loss = Kernel.apply(model(inputs)).sum()  # as Megatron's schedules run it: autograd's engine called directly
    assert raised_in(raised(lambda: custom_backward(loss, None)), iteration=20) == "in a backward of iteration 20"

    def adam() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    handle = OffloadHandle(object(), OffloadConfig())
    handle.on_cuda = False  # the wrapper's frames are what counts here, not its work on a GPU
    step = handle._step_wrapper(adam)
    error = raised(step)
    assert raised_in(error, iteration=7) == "in the optimizer step of iteration 7"
    args = megatron(offload_optimizer_states=True, offload_gpu_memory_cap_gib=17.295, curr_iteration=6)
    line = out_of_memory_line(error, args, int(17.27 * GIB), GIB)
    assert line.startswith(
        "megatron-offload: out of GPU memory under --offload-gpu-memory-cap-gib 17.295, in the optimizer step of "
        "iteration 7: asked for 1.00 GiB with 17.27 GiB reserved at the peak. To move more off the GPU, add: "
    )
    assert raised_in(raised(lambda: adam())) == ""  # outside a forward, a backward and the step
