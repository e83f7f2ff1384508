"""Real megatron-core GPT + DDP + DistributedOptimizer (bf16) with and without offloading.

Runs on the GPU machine only (see scripts/device_check.sh). Everything is compared with torch.equal:
offloading must not change a single bit of training.
"""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests train a megatron-core GPT model", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core installed (scripts/device_check.sh does it)")

from megatron_offload import PrefetchPolicy, attach_offloader  # noqa: E402
from tests.gpu.harness import GPTShape, build_gpt_training, force_skipped_step, init_distributed  # noqa: E402
from tests.gpu.parity import assert_bitwise_equal, masters_of, snapshot, train  # noqa: E402

STEPS = 20
SKIPPED_ITERATION = 7
LEFT_BEHIND = 32 << 20  # GPU memory a built, trained and detached run may leave (what the allocator cannot hand back)


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    init_distributed()


@pytest.fixture(scope="module")
def reference() -> tuple[list[tuple[float, bool]], dict[str, torch.Tensor]]:
    """The run without offloading that every offloaded run must match, skipped step included."""
    training = build_gpt_training(GPTShape(), loss_scale=1.0)
    results = train(training, STEPS, skip_at=SKIPPED_ITERATION)
    assert results[SKIPPED_ITERATION][1] is False and all(
        ok for i, (_, ok) in enumerate(results) if i != SKIPPED_ITERATION
    )
    state = snapshot(training)
    del training
    return results, state


# chunk_mb=0.25 cuts the tiny model's 21 MB of state into dozens of chunks, so the streamed step
# really pipelines; 64 (the default) makes one chunk of it.
@pytest.mark.parametrize("chunk_mb", [0.25, 64.0])
@pytest.mark.parametrize("prefetch", list(PrefetchPolicy))
@pytest.mark.parametrize("offload_master_weights", [True, False])
def test_bitwise_parity_with_a_skipped_step(
    reference, prefetch: PrefetchPolicy, offload_master_weights: bool, chunk_mb: float
) -> None:
    expected_results, expected_state = reference
    training = build_gpt_training(GPTShape(), loss_scale=1.0)
    # fraction=1: all of it moves every step (the default keeps this small state on the GPU, uncapped).
    handle = attach_offloader(
        training.optimizer,
        prefetch=prefetch,
        offload_master_weights=offload_master_weights,
        chunk_mb=chunk_mb,
        fraction=1.0,
    )
    # The masters leave at attach, before the first forward (nothing else exists yet).
    assert all(m.device.type == "cpu" for m in masters_of(training)) == offload_master_weights
    results = train(training, STEPS, skip_at=SKIPPED_ITERATION)
    stats = handle.read_stats()
    assert all(offloader.is_offloaded for offloader in handle.offloaders)
    # One offload per step, plus one at attach when the masters leave; the skipped step moves nothing
    # when nothing had come back before it (a policy that leaves it all for the step).
    assert STEPS - 1 + offload_master_weights <= stats.offloads <= STEPS + offload_master_weights
    assert stats.gpu_bytes_freed > 0
    if chunk_mb < 1:
        assert min(len(offloader.chunks) for offloader in handle.offloaders) > 10
    if prefetch is PrefetchPolicy.STEP:
        assert stats.bytes_streamed > (STEPS - 3) * stats.host_bytes  # every step after the first streams it all
    handle.wait()
    assert results == expected_results
    assert_bitwise_equal(expected_state, snapshot(training))
    handle.detach()


@pytest.mark.parametrize("fraction", [0.5, 0.0, "auto"])
def test_partial_offload_keeps_parity(reference, fraction: float | str) -> None:
    expected_results, expected_state = reference
    training = build_gpt_training(GPTShape(), loss_scale=1.0)
    handle = attach_offloader(training.optimizer, fraction=fraction, chunk_mb=0.25)
    results = train(training, STEPS, skip_at=SKIPPED_ITERATION)
    stats = handle.read_stats()
    total = stats.host_bytes
    # Uncapped, this tiny model fits many times over: `auto` keeps everything after iteration 2. A fixed
    # fraction keeps its share rounded down to whole chunks: at most one chunk more per offloader moves.
    share = 0.0 if fraction == "auto" else fraction
    largest = max(max(offloader.full_sizes()) for offloader in handle.offloaders)
    assert share * total <= stats.offloaded_bytes <= share * total + len(handle.offloaders) * largest
    handle.wait()
    assert results == expected_results
    assert_bitwise_equal(expected_state, snapshot(training))
    handle.detach()


def test_overlapped_grad_reduce_and_param_gather_keep_parity() -> None:
    def run(attach: bool) -> tuple[list, dict[str, torch.Tensor]]:
        training = build_gpt_training(
            GPTShape(), overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=500_000
        )
        handle = attach_offloader(training.optimizer, chunk_mb=0.25, fraction=1.0) if attach else None
        results = train(training, 8)
        if handle is not None:
            handle.wait()
        return results, snapshot(training)

    expected_results, expected_state = run(attach=False)
    results, state = run(attach=True)
    assert results == expected_results
    assert_bitwise_equal(expected_state, state)


def test_the_default_uncapped_with_room_moves_nothing_and_keeps_parity(reference) -> None:
    expected_results, expected_state = reference
    training = build_gpt_training(GPTShape(), loss_scale=1.0)
    handle = attach_offloader(training.optimizer, chunk_mb=0.25)  # --offload-optimizer-states alone
    results = train(training, 3)
    before = handle.read_stats()
    assert handle.kept_bytes() == before.host_bytes  # everything fits: everything stays
    for iteration in range(3, STEPS):
        if iteration == SKIPPED_ITERATION:
            force_skipped_step(training)
        results.append(training.train_step(iteration))
    after = handle.read_stats()
    # From iteration 3 on nothing crosses the link: no byte out, back or streamed.
    assert after.bytes_streamed == before.bytes_streamed and after.bytes_offloaded == before.bytes_offloaded
    assert after.bytes_prefetched == before.bytes_prefetched and not any(o.is_offloaded for o in handle.offloaders)
    assert results == expected_results
    assert_bitwise_equal(expected_state, snapshot(training))
    handle.detach()


def test_the_default_fits_wherever_step_fits_and_never_exceeds_its_peak() -> None:
    # 8 layers of about 0.2 GiB of activations each against 0.3 GiB of state: backward frees far more.
    shape = GPTShape(num_layers=8, hidden_size=512, ffn_hidden_size=2048, seq_length=2048, micro_batch_size=4)
    total = torch.cuda.get_device_properties(0).total_memory

    def run(prefetch: str, budget: int | None = None) -> tuple[int, int, object, int, int]:
        """What the process held before building (earlier tests' and runs' leftovers, which no run here
        allocates), the peak reserved memory of iterations 1-6 above it, the stats, the kept bytes and the
        copies out each step leaves to the next forward. ``budget``: the cap above those leftovers."""
        gc.collect()  # the other run's model, if any, must be gone: its memory would count here
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction(min(1.0, (held + budget) / total) if budget else 1.0)
        try:
            training = build_gpt_training(shape)
            handle = attach_offloader(training.optimizer, prefetch=prefetch, chunk_mb=4)
            streamed_before = None
            try:
                train(training, 2)
                streamed_before = handle.read_stats().bytes_streamed
                train(training, 4)
            except torch.OutOfMemoryError as error:
                ledger = f"kept {handle.kept_bytes()}, copies out pending {handle.pending_offload_bytes()}, left to "
                ledger += f"the forward {handle.left_to_forward()}, natural peak {handle.scheduler.natural}"
                raise AssertionError(
                    f"{prefetch} ran out of memory in iterations {'1-2' if streamed_before is None else '3-6'} under "
                    f"{budget=} above {held=} (what was held before building; {ledger}): {error}"
                ) from None
            stats = handle.read_stats()
            stats.bytes_streamed -= streamed_before
            kept, hides = handle.kept_bytes(), handle.forward_hides()
            handle.detach()
            return held, torch.cuda.max_memory_reserved() - held, stats, kept, hides
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)

    _, step_peak, step_stats, step_kept, _ = run("step")
    assert step_kept == 0 and step_stats.bytes_streamed == 4 * step_stats.host_bytes
    held_before, uncapped_peak, uncapped_stats, uncapped_kept, _ = run("auto")
    assert uncapped_kept == uncapped_stats.host_bytes and uncapped_stats.bytes_streamed == 0
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_reserved() - held_before
    assert left <= LEFT_BEHIND, f"a detached run left {left} bytes on the GPU ({held_before=})"
    # Capped at what `step` needed, the default keeps only what fits beside that peak and never passes it,
    # also with the copies out each step leaves to the next forward (timed from iteration 2 on).
    held, auto_peak, auto_stats, auto_kept, auto_hides = run("auto", budget=step_peak)
    figures = f"peaks {auto_peak=} {step_peak=} {uncapped_peak=} above {held=}, {auto_kept=} {auto_hides=}"
    figures += f", {auto_stats=}"
    assert auto_peak <= step_peak, figures
    assert auto_kept < auto_stats.host_bytes and auto_hides > 0, figures
