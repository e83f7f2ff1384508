"""The host-memory drills through the library API (host_memory_drill.py's ``--api`` child): a slab pinned, a refused
pin raising, and attach under a refused pin or a refused allocation, each compared bitwise with training without
offloading."""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path
from typing import Any

from tests.gpu.host_memory_surface import (
    address_space_capped,
    case,
    differing,
    left_behind,
    refuse_pinning,
    surface,
)
from tests.gpu.host_memory_verdicts import one_line

__all__ = ["api_main"]

STEPS = 3  # iterations trained after attach, compared bitwise with no offloading


def slab_cases() -> dict[str, dict]:
    import torch

    from megatron_offload import HostMemoryError
    from megatron_offload.core import host_memory

    def pinned() -> tuple[list[str], str, dict]:
        slab = host_memory.HostSlab(256 * 2**20, torch.uint8, pin=True)
        ok = slab.pinned
        slab.release()
        return ([] if ok else ["a 256 MiB slab was not pinned on this machine"]), "", {"pinned": ok}

    def refused_raises() -> tuple[list[str], str, dict]:
        original, host_memory._pin = host_memory._pin, refuse_pinning
        try:
            host_memory.HostSlab(1024 * 2**20, torch.uint8, pin=True, on_pin_failure="raise")
        except HostMemoryError as error:
            failures = [] if "could not pin 1.00 GiB" in str(error) else ["the error does not name 1.00 GiB"]
            return failures + one_line(str(error)), str(error), {}
        finally:
            host_memory._pin = original
        return ["no HostMemoryError"], "", {}

    return {"slab-pinned": case(pinned), "slab-pin-refused-raises": case(refused_raises)}


def attach_cases(shape: Any, reference: dict[str, Any], cases: list[str]) -> dict[str, dict]:
    import torch

    from megatron_offload import HostMemoryError, attach_offloader
    from megatron_offload.core import host_memory
    from megatron_offload.megatron import optimizer_adapter as megatron_adapter
    from tests.gpu import harness
    from tests.gpu.parity import snapshot, train

    def after_failed_attach(training: Any, before: dict, masters: dict, intact: dict) -> list[str]:
        """Nothing half set up: the surface unchanged, masters untouched, attach again, train bitwise."""
        try:
            return check_after_failed_attach(training, before, masters, intact)
        except Exception as error:  # a check that breaks is a failure, with the message kept
            return [f"checking what the failed attach left raised {type(error).__name__}: {error}"]

    def check_after_failed_attach(training: Any, before: dict, masters: dict, intact: dict) -> list[str]:
        failures = []
        intact["left_behind"] = left_behind(before, surface(training))
        if intact["left_behind"]:
            failures.append(f"the failed attach left the optimizer half set up: {intact['left_behind'][:6]}")
        changed = differing(masters, snapshot(training))
        intact["state_untouched"] = not changed
        if changed:
            failures.append(f"the failed attach changed the state: {changed[:4]}")
        try:
            handle = attach_offloader(training.optimizer)
            intact["attach_again"] = "ok"
        except Exception as error:  # half set up: say so, and train on with what is there
            handle, intact["attach_again"] = None, f"{type(error).__name__}: {error}"
            failures.append(f"attaching again after the failure: {intact['attach_again']}")
        train(training, STEPS)
        # A handle the failed attach left behind holds the state offloaded: bring it back to compare.
        leftover = getattr(training.optimizer, getattr(megatron_adapter, "_HANDLE_ATTR", ""), None)
        for attached in {id(h): h for h in (handle, leftover) if h is not None}.values():
            attached.detach()
        different = differing(reference, snapshot(training))
        intact["bitwise_equal_to_no_offload"] = not different
        if different:
            failures.append(f"training after the failure differs from no offloading: {different[:4]}")
        return failures

    def pin_refused() -> tuple[list[str], str, dict]:
        training = harness.build_gpt_training(shape)
        before, masters, intact = surface(training), snapshot(training), {}
        original, host_memory._pin = host_memory._pin, refuse_pinning
        error = handle = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    handle = attach_offloader(training.optimizer)
                except HostMemoryError as raised:
                    error = raised
        finally:
            host_memory._pin = original
        warned = [str(w.message) for w in caught if "could not pin" in str(w.message)]
        if error is not None:
            intact["told_by"] = "HostMemoryError at attach"
            return one_line(str(error)) + after_failed_attach(training, before, masters, intact), str(error), intact
        failures = [] if len(warned) == 1 else [f"attach warned {len(warned)} times of the pinning it was refused"]
        message = " ".join(warned)
        failures += one_line(message, "the warning")
        intact["told_by"] = "a warning at attach"
        if warned and "Measured here" not in message:
            failures.append("the warning does not say what pageable copies cost here")
        intact["pinned"] = handle.read_stats().pinned
        train(training, STEPS)
        handle.detach()
        different = differing(reference, snapshot(training))
        intact["bitwise_equal_to_no_offload"] = not different
        if different:
            failures.append(f"training on pageable memory differs from no offloading: {different[:4]}")
        return failures, message, intact

    def allocation_refused() -> tuple[list[str], str, dict]:
        training = harness.build_gpt_training(shape)
        before, masters, intact = surface(training), snapshot(training), {}
        error: Exception | None = None
        handle = None
        with address_space_capped(margin=64 * 2**20):
            try:
                handle = attach_offloader(training.optimizer)
            except Exception as raised:  # what the user would see, whatever it is
                error = raised
        if handle is not None:
            handle.detach()
            return ["attach succeeded although the host refused 64 MiB more"], "", intact
        message = f"{type(error).__name__}: {error}"
        failures = one_line(message)
        if not isinstance(error, HostMemoryError) or "could not allocate" not in str(error):
            failures.append("not a HostMemoryError saying the host could not allocate the state")
        return failures + after_failed_attach(training, before, masters, intact), message, intact

    attach = {"pin-refused-at-attach": pin_refused, "allocation-refused-at-attach": allocation_refused}
    results = {}
    for name, function in attach.items():
        if name in cases:
            gc.collect()
            torch.cuda.empty_cache()
            results[name] = case(function)
    return results


def api_main(out_json: Path, cases: list[str]) -> int:
    """The API cases asked for, in this process (a child of the drill, under its bound)."""
    import megatron.core
    import torch

    from benchmarks.gpt_training import destroy_distributed, init_distributed
    from tests.gpu import harness
    from tests.gpu.parity import snapshot, train

    init_distributed()
    found = {name: item for name, item in slab_cases().items() if name in cases}
    if {"pin-refused-at-attach", "allocation-refused-at-attach"} & set(cases):
        shape = harness.GPTShape(
            num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, vocab_size=16384
        )
        training = harness.build_gpt_training(shape)
        train(training, STEPS)
        reference = snapshot(training)
        del training
        gc.collect()
        found |= attach_cases(shape, reference, cases)
    results = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "megatron-core": megatron.core.__version__},
        "cases": found,
    }
    out_json.write_text(json.dumps(results, indent=1))
    for name, item in results["cases"].items():
        print(f"{name}: {'ok' if item['passed'] else 'FAIL: ' + '; '.join(item['failures'])}", flush=True)
    destroy_distributed()
    return 0
