"""An RL loop on one GPU: train, sleep, hand the GPU to an inference engine, wake, train on.

The trainer is a megatron-core GPT the size of configs/tiny.yaml (4 layers, hidden 512, vocab 32000;
DDP with the distributed optimizer, bf16, torch Adam). The inference engine is a stand-in: another
process, with its own CUDA context, that at each rollout takes all the device memory it finds free,
writes over it (as a KV cache would) and gives it back. The loop:

    sleeper = megatron_offload.sleep_wake_for(optimizer, model)   # once, after the optimizer is built
    sleeper.prepare(optimizer=True, grads=True, params=True)      # once, at setup: pins host memory
    for iteration in ...:
        train_step()                                              # forward, backward, optimizer.step()
        # (an RL framework syncs the new weights to the inference engine here, before params sleep)
        sleeper.sleep(optimizer=True, grads=True, params=True)    # device memory back to the device
        engine.generate()                                         # the engine takes it
        engine.release()                                          # and gives it back
        sleeper.wake()                                            # everything back, bitwise

At the end the same model is trained again without the pauses (and without megatron-offload), and
every loss, model parameter, fp32 master and Adam moment is compared bitwise. Exit status 0 when all
are equal and the engine got the memory each sleep gave back, 1 otherwise.

    python examples/rl_sleep_wake.py [--iterations 6] [--offload-optimizer-states]

Needs one CUDA GPU and megatron-core (0.16 to 0.19); run from the repository root or with
megatron-offload installed.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

GB = 1e9
# What the stand-in leaves free: room for its own kernels, and for what the device's free memory
# moves by on its own between the trainer's reading and the engine's.
ENGINE_MARGIN = 256 * 2**20


# ------------------------------------------------------------------------------ the stand-in engine
def run_stand_in_engine() -> None:
    """The inference engine's process: answers "generate" (take every free byte but a margin, write a
    pattern over it, reply with the bytes taken) and "release" (free it all), one line each."""
    import torch

    torch.empty(1, device="cuda")  # its CUDA context exists from setup on, as a co-located engine's does
    print("ready", flush=True)
    held = None
    for line in sys.stdin:
        command = line.strip()
        if command == "generate":
            free, _ = torch.cuda.mem_get_info()
            held = torch.empty(max(free - ENGINE_MARGIN, 0), dtype=torch.uint8, device="cuda")
            # A tensor of the trainer still pointing at memory its sleep gave back would read this pattern.
            held.fill_(0xA5)
            torch.cuda.synchronize()
            print(held.numel(), flush=True)
        elif command == "release":
            held = None
            torch.cuda.empty_cache()  # back to the device, for the trainer's wake
            print("released", flush=True)
        elif command == "quit":
            return


class StandInEngine:
    """The trainer's side of the stand-in: a child process driven over its stdin and stdout."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--stand-in"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._expect("ready")

    def _ask(self, command: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"the stand-in engine died on {command!r} (exit status {self.process.poll()})")
        return answer

    def _expect(self, answer: str) -> None:
        assert self.process.stdout is not None
        got = self.process.stdout.readline().strip()
        if got != answer:
            raise RuntimeError(f"the stand-in engine said {got!r}, not {answer!r}")

    def generate(self) -> int:
        """A rollout: returns the bytes of device memory the engine took."""
        return int(self._ask("generate"))

    def release(self) -> None:
        if self._ask("release") != "released":
            raise RuntimeError("the stand-in engine did not release its memory")

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
        self.process.wait(timeout=60)


# ------------------------------------------------------------------------------------ the trainer
SEED = 1234
LAYERS, HIDDEN, FFN, HEADS, VOCAB, SEQ = 4, 512, 2048, 8, 32000, 512  # configs/tiny.yaml
MICRO_BATCH, MICRO_BATCHES = 4, 2  # global batch 8 on one GPU


def init_distributed() -> None:
    """One process is a world of one (under torchrun, its variables are used)."""
    import torch
    from megatron.core import parallel_state

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        torch.distributed.init_process_group("nccl")
    else:
        # A world of one: an in-process store, so no TCP port that two runs on one machine could both want.
        torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()


def build() -> tuple[list[Any], Any]:
    """The DDP-wrapped GPT and its megatron-core optimizer; the same weights at every call."""
    import random

    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    random.seed(SEED)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,  # without apex
        gradient_accumulation_fusion=False,  # without apex
    )
    gpt = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=True,  # tied, as configs/tiny.yaml (Megatron-LM's default)
    )
    for param in gpt.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    gpt.cuda()
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = [DistributedDataParallel(config, ddp, Float16Module(config, gpt))]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            clip_grad=1.0,
            bf16=True,
            use_distributed_optimizer=True,
        ),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def batches(iteration: int) -> list[tuple[Any, Any, Any]]:
    """(tokens, labels, position ids) of each micro-batch: random tokens, the same for a given iteration."""
    import torch

    generator = torch.Generator().manual_seed(SEED + iteration)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES, MICRO_BATCH, SEQ + 1), generator=generator).cuda()
    positions = torch.arange(SEQ, device="cuda").expand(MICRO_BATCH, SEQ)
    return [(t[:, :-1], t[:, 1:], positions) for t in tokens]


def mean_loss(per_token: Any) -> tuple[Any, dict[str, Any]]:
    loss = per_token.float().mean()
    return loss, {"lm loss": loss.detach()}


def forward_step(data: Any, model: Any) -> tuple[Any, Any]:
    tokens, labels, positions = next(data)
    return model(tokens, positions, None, labels=labels), mean_loss


def train_step(model: list[Any], optimizer: Any, iteration: int) -> float:
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches(iteration)),
        model=model,
        num_microbatches=MICRO_BATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    optimizer.step()
    return torch.stack([r["lm loss"] for r in reports]).mean().item()


def snapshot(model: list[Any], optimizer: Any) -> dict[str, Any]:
    """Every model parameter, fp32 master and Adam tensor, copied to the host."""
    out = {f"model.{name}": p.detach().cpu() for name, p in model[0].named_parameters()}
    for i, dist_opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        masters = [p for group in dist_opt.optimizer.param_groups for p in group["params"]]
        for j, master in enumerate(masters):
            out[f"optimizer{i}.{j}.master"] = master.detach().cpu()
            for key, value in dist_opt.optimizer.state.get(master, {}).items():
                if hasattr(value, "shape") and value.shape == master.shape:
                    out[f"optimizer{i}.{j}.{key}"] = value.detach().cpu()
    return out


def train(iterations: int, engine: StandInEngine | None, offload_states: bool) -> tuple[list[float], dict, bool]:
    """Train; with an engine, sleep and hand it the GPU after every step. Returns the losses, the final
    snapshot and whether the engine always got the memory the sleeps gave back."""
    import torch

    import megatron_offload

    model, optimizer = build()
    handle = megatron_offload.attach_offloader(optimizer) if offload_states and engine else None
    sleeper = None
    if engine is not None:
        sleeper = megatron_offload.sleep_wake_for(optimizer, model)
        prepared = sleeper.prepare(optimizer=True, grads=True, params=True)
        print(f"setup: {prepared.describe()}", flush=True)
    losses, engine_got_it = [], True
    for iteration in range(iterations):
        losses.append(train_step(model, optimizer, iteration))
        if sleeper is None or engine is None:
            continue
        asleep = sleeper.sleep(optimizer=True, grads=True, params=True)
        taken = engine.generate()
        engine.release()
        awake = sleeper.wake()
        got_it = taken >= asleep.device_free_after - 2 * ENGINE_MARGIN
        engine_got_it = engine_got_it and got_it
        print(
            f"iteration {iteration}: loss {losses[-1]:.6f} | sleep {asleep.describe()} | engine took "
            f"{taken / GB:.2f} GB{'' if got_it else ' (LESS than the sleep gave back)'} | wake {awake.describe()}",
            flush=True,
        )
    if sleeper is not None:
        sleeper.close()  # state back in storage of its own, host slabs freed
    if handle is not None:
        handle.detach()  # the state back on the GPU for good
    state = snapshot(model, optimizer)
    del model, optimizer, sleeper, handle
    gc.collect()
    torch.cuda.empty_cache()
    return losses, state, engine_got_it


NO_GPU = (
    "rl_sleep_wake.py: no CUDA GPU found: this example trains on one and hands its memory to another process. "
    "Without one, the sleep and wake tests check these calls on the CPU: bash scripts/test.sh (all tests), "
    "or python -m pytest tests -k sleep in its .venv; docs/sleep-wake.md walks through the calls"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument(
        "--offload-optimizer-states",
        action="store_true",
        help="also offload the optimizer state between steps (attach_offloader): sleep then shares its host slab",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_offload from this checkout
    from megatron_offload.core.gpu_memory import use_expandable_segments_by_default

    note = use_expandable_segments_by_default()  # before CUDA starts
    if note:
        print(note, flush=True)
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    engine = StandInEngine()  # started at setup, like a co-located inference engine
    try:
        init_distributed()
        losses, state, engine_got_it = train(args.iterations, engine, args.offload_optimizer_states)
        expected_losses, expected, _ = train(args.iterations, None, False)
    finally:
        engine.close()
    different = [key for key in expected if key not in state or not torch.equal(expected[key], state[key])]
    bitwise = losses == expected_losses and state.keys() == expected.keys() and not different
    print(f"losses with the pauses:    {losses}")
    print(f"losses without the pauses: {expected_losses}")
    print(
        f"bitwise equal to training without the pauses: {'yes' if bitwise else 'NO'} ({len(expected)} tensors "
        f"compared{', differing: ' + ', '.join(different[:5]) if different else ''}); the engine got the memory "
        f"every sleep gave back: {'yes' if engine_got_it else 'NO'}"
    )
    torch.distributed.destroy_process_group()
    return 0 if bitwise and engine_got_it else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--stand-in"]:
        run_stand_in_engine()
    else:
        sys.exit(main())
