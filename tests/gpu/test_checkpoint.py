"""Save and resume through megatron-core's torch_dist checkpointing while the optimizer state is offloaded.

Proves, bitwise, on a real GPT + DDP + DistributedOptimizer (bf16) with the offloader attached:
- a run saved after step 4 (its state parked in host memory at that moment) that keeps training gives exactly
  the losses, params, fp32 masters, Adam moments and step counts of an uninterrupted run: the save reads the
  offloaded state and leaves it whole;
- a run built with another seed, trained 2 steps (its own state now in the host copies), that loads the
  checkpoint and trains steps 5..9 gives exactly the same: the load reaches what the next step uses, and no
  stale host copy comes back (its step-5 loss checks the model load, the rest the optimizer state).
Save and load call megatron-core as Megatron-LM's training/checkpointing.py does for ``--ckpt-format torch_dist
--use-distributed-optimizer`` with default flags: sharding type dp_reshardable, fully parallel sync save.
Two megatron-core quirks of the torch-Adam path (no TE/apex, as on the GPU machine), both in 0.16.1 and 0.19.2,
shape the test; neither involves offloading. See ``restore_torch_adam_steps`` and the comment before the load.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests train a megatron-core GPT model", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core installed (scripts/device_check.sh does it)")
# megatron-core's torch_dist writer processes call psutil; without it they die and save() waits forever.
pytest.importorskip("psutil", reason="megatron-core's torch_dist save needs psutil (it hangs without)")

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy  # noqa: E402
from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

from megatron_offload import attach_offloader  # noqa: E402
from megatron_offload.megatron.optimizer_adapter import OffloadHandle, distributed_optimizers  # noqa: E402
from tests.gpu.harness import GPTShape, GPTTraining, build_gpt_training, init_distributed  # noqa: E402
from tests.gpu.parity import assert_bitwise_equal, snapshot  # noqa: E402

STEPS = 10
SAVE_AFTER = 5  # steps 0..4 run before the save
Outcome = tuple[list[tuple[float, bool]], dict[str, torch.Tensor], list[float]]  # losses, snapshot(), adam_steps()


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    init_distributed()


def sharded_sd_metadata() -> dict:
    """Megatron-LM's _build_sharded_state_dict_metadata for torch_dist + distributed optimizer, default flags."""
    return {
        "distrib_optim_sharding_type": "dp_reshardable",  # no --dist-ckpt-optim-fully-reshardable
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


def save_checkpoint(training: GPTTraining, checkpoint_dir: str) -> None:
    """save_checkpoint: generate_state_dict (unwrapped model), then a synchronous, fully parallel save."""
    metadata = sharded_sd_metadata()
    state_dict = {"model": unwrap_model(training.model)[0].sharded_state_dict(metadata=metadata)}
    state_dict["optimizer"] = training.optimizer.sharded_state_dict(state_dict, metadata=metadata)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), metadata["dp_cp_group"])
    dist_checkpointing.save(
        state_dict,
        checkpoint_dir,
        sharded_strategy=strategy,
        validate_access_integrity=True,
        async_sharded_save=False,
        content_metadata=_clean_metadata_for_serialization(metadata),
    )


def load_checkpoint(training: GPTTraining, checkpoint_dir: str) -> None:
    """load_checkpoint: metadata from the checkpoint, is_loading=True, load, then model and optimizer loads."""
    metadata = dist_checkpointing.load_content_metadata(checkpoint_dir)
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    sharded = {"model": unwrap_model(training.model)[0].sharded_state_dict(metadata=metadata)}
    sharded["optimizer"] = training.optimizer.sharded_state_dict(sharded, metadata=metadata, is_loading=True)
    state_dict = dist_checkpointing.load(
        sharded,
        checkpoint_dir,
        sharded_strategy=TorchDistLoadShardedStrategy(),
        validate_access_integrity=True,
        strict="assume_ok_unexpected",  # --dist-ckpt-strictness default
    )
    training.model[0].load_state_dict(state_dict["model"], strict=True)
    training.optimizer.load_state_dict(state_dict["optimizer"])
    restore_torch_adam_steps(training, state_dict["optimizer"])


def restore_torch_adam_steps(training: GPTTraining, optimizer_state_dict: dict) -> None:
    """Undo a megatron-core bug of the torch-Adam path (TE/apex FusedAdam keep the step in param_groups instead).

    DistributedOptimizer.load_state_dict gives every param one shared ``step`` tensor, which torch Adam then
    advances once per param per step, and the dp_reshardable load copies the pre-load step count over the
    checkpoint's. Give each param its own tensor holding the checkpoint's count, as in an uninterrupted run.
    """
    (dist_opt,) = distributed_optimizers(training.optimizer)
    (step,) = {group["step"] for group in optimizer_state_dict["optimizer"]["param_groups"]}
    for state in dist_opt.optimizer.state.values():
        if "step" in state:
            state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)


def adam_steps(training: GPTTraining) -> list[float]:
    """Every param's Adam step count (the snapshot holds only param-shaped state)."""
    states = [state for opt in distributed_optimizers(training.optimizer) for state in opt.optimizer.state.values()]
    return sorted(float(state["step"]) for state in states if "step" in state)


def finish(training: GPTTraining, handle: OffloadHandle) -> Outcome:
    """Train steps 5..9, then everything to compare (the state brought back to the GPU first)."""
    results = [training.train_step(iteration) for iteration in range(SAVE_AFTER, STEPS)]
    assert all(offloader.is_offloaded for offloader in handle.offloaders)
    handle.wait()
    return results, snapshot(training), adam_steps(training)


@pytest.fixture(scope="module")
def reference() -> Outcome:
    """The uninterrupted run (offloading, which test_megatron_offload proves bitwise neutral)."""
    training = build_gpt_training(GPTShape())
    handle = attach_offloader(training.optimizer, fraction=1.0)
    head = [training.train_step(iteration) for iteration in range(SAVE_AFTER)]
    tail, state, steps = finish(training, handle)
    handle.detach()
    return head + tail, state, steps


@pytest.mark.parametrize("offload_master_weights", [True, False])
def test_torch_dist_save_and_resume_is_bitwise_exact(reference, tmp_path, offload_master_weights: bool) -> None:
    expected_results, expected_state, expected_steps = reference
    checkpoint_dir = tmp_path / "iter_0000005"
    checkpoint_dir.mkdir()  # Megatron-LM's ensure_directory_exists; save() wants the directory to exist

    saving = build_gpt_training(GPTShape())
    saving_handle = attach_offloader(saving.optimizer, offload_master_weights=offload_master_weights, fraction=1.0)
    assert [saving.train_step(iteration) for iteration in range(SAVE_AFTER)] == expected_results[:SAVE_AFTER]
    assert all(offloader.is_offloaded for offloader in saving_handle.offloaders)  # the save meets offloaded state
    allocated_before_save = torch.cuda.memory_allocated()
    save_checkpoint(saving, str(checkpoint_dir))
    # The save read the state from host memory: nothing came back to the GPU for it.
    assert all(offloader.is_offloaded for offloader in saving_handle.offloaders)
    assert torch.cuda.memory_allocated() <= allocated_before_save + 2**20
    saved_run = finish(saving, saving_handle)

    # A different seed and 2 steps of its own: with torch Adam, megatron-core cannot build the load-side sharded
    # state dict before the first step (DistributedOptimizer.state_dict asserts on the empty Adam state), and the
    # host copies now hold this run's own state, so a stale copy coming back after the load would show.
    resumed = build_gpt_training(GPTShape(), seed=4321)
    handle = attach_offloader(resumed.optimizer, offload_master_weights=offload_master_weights, fraction=1.0)
    for iteration in (100, 101):
        resumed.train_step(iteration)
    assert all(offloader.is_offloaded for offloader in handle.offloaders)
    load_checkpoint(resumed, str(checkpoint_dir))
    resumed_run = finish(resumed, handle)

    for name, (results, state, steps) in {"saving run": saved_run, "resumed run": resumed_run}.items():
        assert results[0] == expected_results[SAVE_AFTER], f"{name}: loss at step {SAVE_AFTER} differs"
        assert results == expected_results[SAVE_AFTER:], f"{name}: losses of steps {SAVE_AFTER}..{STEPS - 1} differ"
        assert_bitwise_equal(expected_state, state)
        assert steps == expected_steps, f"{name}: Adam step counts differ"
    saving_handle.detach()
    handle.detach()
