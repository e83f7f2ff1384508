"""Host-memory drills on a GPU machine (the CPU suite runs their library side in tests/test_host_memory.py):

    python -m tests.gpu.host_memory_drill --out results/host-memory     # exit 0 when every case passed
    python -m tests.gpu.host_memory_drill --out DIR --only short-at-start   # one drill (or named cases)

The drills (host_memory_verdicts.DRILLS): ``short-at-start`` (cases 3, 5), ``short-while-pinning`` (1, 2,
4), ``short-during-save`` (6). ``DIR/host-memory.json`` holds each case (whether it passed, its failures,
its ``verdict`` line, the message as the user sees it: the warning or the error line of the log, what was
checked to be intact, its seconds and its log), each drill's verdict and the run's ``verdict``; the
drill prints one line per drill last. Every child runs under drill_runs.run_bounded: a case that hangs
ends with a verdict, never a wait.

Through the library API, in one child (``--api``; tests/gpu/harness.py's bf16 GPT on one GPU, 67M params):
1. ``slab-pinned``: a HostSlab of 256 MiB is pinned here; ``slab-pin-refused-raises``: with pinning refused,
   ``on_pin_failure="raise"`` is a HostMemoryError naming the bytes.
2. ``pin-refused-at-attach``: cudaHostRegister answers 2 (out of memory) to the offloader's slab at attach.
   The user is told at attach (a warning with the measured cost of pageable copies, or a HostMemoryError),
   and nothing is lost: training on goes bitwise as without offloading (or, after an error, nothing is
   left half set up).
3. ``allocation-refused-at-attach``: the host refuses the slab's allocation itself (the process's address
   space capped at what it holds, RLIMIT_AS, around ``attach_offloader`` only): a HostMemoryError, and
   nothing half set up: no wrapper, hook or attribute left on the optimizer and model, the fp32 masters
   untouched, a second attach works, and training then matches training without offloading bitwise.
In Megatron-LM's loop (scripts/pretrain_gpt.py, configs/tiny.yaml; each case this module again under torchrun
with ``--megatron CASE``, which makes the change on module attributes, never in library code):
4. ``pin-refused-megatron``: the same refusal; the run completes, its log carries the warning.
5. ``node-too-small``: the real MemAvailable, as if 4096 ranks shared this node: refused before the model
   is built (Megatron's parameter-count line absent) and before iteration 1, naming the bytes per rank,
   the ranks, what is available and ``--no-offload-host-memory-check``;
   ``node-too-small-check-off``: the same node with that flag trains (3 iterations).
6. ``host-short-during-save``: the library pins its host memory once, at attach (the OS cannot take pinned
   pages back), so what runs short during training is everything else; here the checkpoint save of
   iteration 10 stages its tensors with the address space capped at what the process holds (a real
   refusal of the C allocator). The run ends with that error; the checkpoint of iteration 5 is complete,
   the tracker names it, the save cut short is incomplete and is not what a new run loads, and that run,
   resumed from iteration 5, repeats iterations 6-10 with the same grad norms and losses, bitwise as
   logged, but for what the control shows too: the same two runs without offloading (as the crash
   drills have), sorted by crash_verdict.judge. Megatron-LM's log has one such difference: the loss it
   logs at the second iteration of every process is the mean of the process's first two iterations
   (``training_log`` in megatron/training/training.py, megatron-core 0.19.2: ``should_reset = not
   is_first_iteration`` keeps the loss sums of a process's first iteration), so the resumed run logs
   iteration 7 as the mean of 6 and 7 where the refused run logged 7 alone. No Megatron setting changes
   it (``--log-interval 1`` logs every iteration; a longer interval only hides the per-iteration values).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import re
import resource
import runpy
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.memory_report import last_error_line
from tests.drills import drill_checkpoints, drill_runs
from tests.drills.crash_verdict import Verdict, judge, logged_differences
from tests.gpu.host_memory_verdicts import API_CASES, add_verdicts, lines, one_line, select

ROOT = Path(__file__).resolve().parents[2]

TINY = ["--config", "configs/tiny.yaml", "--offload-optimizer-states"]
RANKS = 4096  # node-too-small: the real MemAvailable, shared as if by this many ranks
SAVE_INTERVAL, SHORT_AT = 5, 10  # host-short-during-save: saves at 5 and 10, the one at 10 refused
SHORT_RUNS = ["during-save", "resumed", "during-save-control", "resumed-control"]  # host-short-during-save's
RUN_BOUND_S, API_BOUND_S = 150.0, 300.0
STEPS = 3  # API cases: iterations trained after attach, compared bitwise with no offloading
DRILL_LINE = "megatron-offload host-memory drill:"
MODEL_BUILT = re.compile(r"number of parameters on \(")  # Megatron's line once the model is built
HOST_REFUSED = "can't allocate memory"  # torch's CPU allocator, when the OS refuses


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


# ------------------------------------------------------------------------------------ API cases
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


def snapshot(training: Any) -> dict[str, Any]:
    """Model params, fp32 masters and Adam moments, cloned (the state must be on the GPU: detach first)."""
    from megatron_offload.megatron.optimizer_adapter import distributed_optimizers

    tensors = {f"model.{name}": p.detach().clone() for name, p in training.model[0].named_parameters()}
    for o, dist_opt in enumerate(distributed_optimizers(training.optimizer)):
        for g, group in enumerate(dist_opt.shard_fp32_from_float16_groups):
            tensors |= {f"opt{o}.master.{g}.{i}": m.detach().clone() for i, m in enumerate(group)}
        inner = dist_opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, param in enumerate(group["params"]):
                for key, value in inner.state.get(param, {}).items():
                    if hasattr(value, "shape") and value.shape == param.shape:
                        tensors[f"opt{o}.{g}.{i}.{key}"] = value.detach().clone()
    return tensors


def differing(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    import torch

    if expected.keys() != actual.keys():
        return sorted(expected.keys() ^ actual.keys())
    return [key for key in expected if not torch.equal(expected[key], actual[key])]


def train(training: Any, steps: int = STEPS) -> None:
    for iteration in range(steps):
        training.train_step(iteration)


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
        train(training)
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
        train(training)
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

    init_distributed()
    found = {name: item for name, item in slab_cases().items() if name in cases}
    if {"pin-refused-at-attach", "allocation-refused-at-attach"} & set(cases):
        shape = harness.GPTShape(
            num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, vocab_size=16384
        )
        training = harness.build_gpt_training(shape)
        train(training)
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


# ----------------------------------------------------------------------- Megatron-LM's loop cases
def refuse_host_memory_at_save(nth: int) -> None:
    """The ``nth`` checkpoint save stages its tensors (unpinned) with the address space capped at what
    this process holds: the C allocator's real refusal, inside Megatron's own save."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors
    saves = [0]

    def preload_then_maybe_refuse(write_buckets: Any, non_blocking: bool = True) -> Any:
        saves[0] += 1
        if saves[0] != nth:
            return preload(write_buckets, non_blocking)
        print(f"{DRILL_LINE} save {nth}: host memory capped at what the process holds (RLIMIT_AS)", flush=True)
        with address_space_capped(margin=8 * 2**20):
            return preload(write_buckets, False)

    FileSystemWriterAsync.preload_tensors = staticmethod(preload_then_maybe_refuse)


def run_in_megatron(name: str) -> None:
    from megatron_offload.core import host_memory

    if name == "pin-refused-megatron":
        host_memory._pin = refuse_pinning
    elif name.startswith("node-too-small"):
        host_memory.ranks_on_this_node = lambda: RANKS  # the real MemAvailable, shared as if by RANKS ranks
    elif name.startswith("host-short-during-save"):  # with offloading, and its control without
        refuse_host_memory_at_save(SHORT_AT // SAVE_INTERVAL)
    runpy.run_path(str(ROOT / "scripts" / "pretrain_gpt.py"))["main"]()  # as users run it: --config expanded


def megatron_run(name: str, args: list[str], out: Path, offload: bool = True) -> tuple[drill_runs.Outcome, list[str]]:
    """One bounded torchrun of this file with ``--megatron NAME``: how it ended, and a failure if stopped."""
    tiny = TINY if offload else [arg for arg in TINY if arg != "--offload-optimizer-states"]
    command = [*drill_runs.torchrun(1), "-m", "tests.gpu.host_memory_drill", "--megatron", name, *tiny, *args]
    outcome = drill_runs.run_bounded(command, out / f"host-memory-{name}.log", bound_s=RUN_BOUND_S, cwd=ROOT)
    print(f"[{name}] {'stopped: ' + outcome.stopped if outcome.stopped else f'exit {outcome.returncode}'}", flush=True)
    return outcome, [drill_runs.verdict(name, outcome)] if outcome.stopped else []


def line_with(text: str, *needles: str) -> str:
    """The first log line holding every needle (what the user reads), else the run's telling last line."""
    found = next((line.strip() for line in text.splitlines() if all(n in line for n in needles)), None)
    return re.sub(r"^\[rank\d+\]:\s*", "", found) if found else last_error_line(text)


def worker_part(text: str) -> str:
    """The log up to torchrun's own report of a failed worker (whose traceback is torchrun's, not the user's)."""
    return re.split(r".*elastic/multiprocessing/api\.py.*failed \(exitcode", text, maxsplit=1)[0]


def pin_refused_megatron(out: Path) -> tuple[list[str], str, dict]:
    outcome, failures = megatron_run("pin-refused-megatron", ["--train-iters", "5"], out)
    text = outcome.text
    intact = {"last_iteration": drill_runs.last_iteration(text)}
    if not failures and outcome.returncode != 0:
        failures.append(f"exited {outcome.returncode}: {last_error_line(text)}")
    if "using pageable memory instead" not in text:
        failures.append("no warning that pinning was refused")
    failures += one_line(line_with(text, "could not pin"), "the warning")
    if intact["last_iteration"] != 5:
        failures.append(f"the run did not reach iteration 5 ({intact['last_iteration']})")
    return failures, line_with(text, "could not pin"), intact


def node_too_small(out: Path) -> tuple[list[str], str, dict]:
    outcome, failures = megatron_run("node-too-small", ["--train-iters", "5"], out)
    text = outcome.text
    message = line_with(text, "rank(s) on this node")
    intact = {
        "model_built_before_refusal": bool(MODEL_BUILT.search(text)),
        "iterations_run": drill_runs.last_iteration(text),
        "traceback_shown": "Traceback (most recent call last)" in worker_part(text),
    }
    if not failures and outcome.returncode == 0:
        failures.append("the run was not refused")
    for needle in (f"x {RANKS} rank(s) on this node", "GiB of host memory per rank", "GiB is available"):
        if needle not in message:
            failures.append(f"the message lacks {needle!r}")
    if "--no-offload-host-memory-check" not in message:
        failures.append("the message does not name --no-offload-host-memory-check")
    if intact["iterations_run"] is not None:
        failures.append(f"refused only after iteration {intact['iterations_run']}")
    if intact["model_built_before_refusal"]:
        failures.append("refused only after the model was built (Megatron's parameter count is in the log)")
    if intact["traceback_shown"]:
        failures.append("the refusal came with a traceback, not one line")
    return failures, message, intact


def node_too_small_check_off(out: Path) -> tuple[list[str], str, dict]:
    # 3 iterations: tiny.yaml's 2 warm-up iterations must be fewer than the run's (Megatron asserts so).
    args = ["--train-iters", "3", "--no-offload-host-memory-check"]
    outcome, failures = megatron_run("node-too-small-check-off", args, out)
    intact = {"last_iteration": drill_runs.last_iteration(outcome.text)}
    if not failures and (outcome.returncode != 0 or intact["last_iteration"] != 3):
        failures.append(f"with the check off the run did not train 3 iterations: {last_error_line(outcome.text)}")
    return failures, "", intact


def refused_then_resumed(
    out: Path, scratch: Path, offload: bool
) -> tuple[list[str], drill_runs.Outcome, drill_runs.Outcome, dict[str, Any]]:
    """The run whose save of iteration 10 is refused, then a new run resumed from what it left: the
    failures of their own checks (refusal, tracker, cut-short save, what the resume loaded), both runs,
    and what was checked."""
    side = "" if offload else "-control"
    save = scratch / f"host-short{side}"
    ckpt = ["--ckpt-format", "torch_dist", "--train-iters", str(SHORT_AT)]
    args = [*ckpt, "--save", str(save), "--save-interval", str(SAVE_INTERVAL)]
    refused, failures = megatron_run(f"host-short-during-save{side}", args, out, offload)
    text = refused.text
    last = SHORT_AT - SAVE_INTERVAL
    intact: dict[str, Any] = {
        "tracker": drill_checkpoints.last_complete_iteration(save),
        "tracked_save_complete": drill_checkpoints.is_complete(save / f"iter_{last:07d}"),
        "cut_short": drill_checkpoints.cut_short(save),
    }
    if not failures and refused.returncode == 0:
        failures.append("the run ended well: the host's refusal was not provoked")
    if HOST_REFUSED not in text:
        failures.append(f"no {HOST_REFUSED!r} in the log")
    if drill_runs.last_iteration(text) != SHORT_AT:
        failures.append(f"the run did not reach iteration {SHORT_AT} before its save")
    if intact["tracker"] != last or not intact["tracked_save_complete"]:
        failures.append(f"the tracker names {intact['tracker']}, not the complete save of iteration {last}")
    if (save / f"iter_{SHORT_AT:07d}").exists() and f"iter_{SHORT_AT:07d}" not in intact["cut_short"]:
        failures.append(f"the refused save of iteration {SHORT_AT} looks complete")
    resumed, resume_failures = megatron_run(f"host-short-resumed{side}", [*ckpt, "--load", str(save)], out, offload)
    failures += resume_failures
    intact["resumed_loaded"] = [
        int(i) for i in re.findall(r"successfully loaded checkpoint .* at iteration (\d+)", resumed.text)
    ]
    if intact["resumed_loaded"] != [last]:
        failures.append(f"the resumed run loaded {intact['resumed_loaded']}, not iteration {last}")
    logged = sorted(drill_checkpoints.losses_and_grad_norms(resumed.text))
    if logged != RESUMED:
        failures.append(f"the resumed run logged iterations {logged}, not {RESUMED}")
    return [f"{f} (without offloading)" if not offload else f for f in failures], refused, resumed, intact


RESUMED = list(range(SHORT_AT - SAVE_INTERVAL + 1, SHORT_AT + 1))  # the iterations the resumed run repeats


def resume_verdict(ours: tuple[str, str], control: tuple[str, str] | None) -> Verdict:
    """The resumed run's logged losses and grad norms against the refused run's, bitwise as printed, each
    difference sorted by the control's (the same two runs without offloading; None: none to ask)."""
    differences = logged_differences(*ours, RESUMED)
    return judge(differences, None if control is None else logged_differences(*control, RESUMED))


def host_short_during_save(out: Path, scratch: Path) -> tuple[list[str], str, dict]:
    failures, refused, resumed, intact = refused_then_resumed(out, scratch, offload=True)
    control_failures, control_refused, control_resumed, intact["control"] = refused_then_resumed(
        out, scratch, offload=False
    )
    # A control that did not refuse and resume as asked cannot tell whose a difference is.
    control = None if control_failures else (control_refused.text, control_resumed.text)
    verdict = resume_verdict((refused.text, resumed.text), control)
    intact["resume"] = verdict.status
    intact["megatron_core_differences"] = verdict.megatron_core
    intact["control_only_differences"] = verdict.control_only
    intact["control_failures"] = control_failures
    return failures + verdict.failures, line_with(refused.text, HOST_REFUSED), intact


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--megatron":
        name = sys.argv[2]
        sys.argv[1:] = sys.argv[3:]
        run_in_megatron(name)
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--api":
        return api_main(Path(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "host-memory-results")
    parser.add_argument("--only", nargs="*", metavar="DRILL_OR_CASE", help="drills or cases (default: all)")
    args = parser.parse_args()
    try:
        cases = select(args.only)
    except ValueError as error:
        parser.error(str(error))
    drill_runs.exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"cases": {}}
    api_cases = [name for name in cases if name in API_CASES]
    if api_cases:
        report = run_api_cases(args.out, api_cases)
    megatron_cases: dict[str, Callable[[], tuple[list[str], str, dict]]] = {
        "pin-refused-megatron": lambda: pin_refused_megatron(args.out),
        "node-too-small": lambda: node_too_small(args.out),
        "node-too-small-check-off": lambda: node_too_small_check_off(args.out),
        "host-short-during-save": lambda: host_short_during_save(args.out, scratch),
    }
    logs = {"host-short-during-save": ", ".join(f"host-memory-host-short-{run}.log" for run in SHORT_RUNS)}
    scratch = Path(tempfile.mkdtemp(prefix="offload-host-memory-"))
    try:
        # Written before and after every case, so a drill cut short by a time limit keeps what it finished.
        (args.out / "host-memory.json").write_text(json.dumps(add_verdicts(copy.deepcopy(report), cases), indent=1))
        for name in (name for name in cases if name in megatron_cases):
            report["cases"][name] = case(megatron_cases[name]) | {"log": logs.get(name, f"host-memory-{name}.log")}
            (args.out / "host-memory.json").write_text(json.dumps(add_verdicts(copy.deepcopy(report), cases), indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = add_verdicts(report, cases)
    (args.out / "host-memory.json").write_text(json.dumps(report, indent=1))
    for name in cases:
        print(f"{name:30} {report['cases'][name]['verdict']}")
    print("\n".join(lines(report)))
    return 0 if report["passed"] else 1


def run_api_cases(out: Path, cases: list[str]) -> dict[str, Any]:
    """The API cases in one bounded child: its report, or one failing case per case asked for."""
    api_json = out / "host-memory-api.json"
    api_json.unlink(missing_ok=True)
    command = [sys.executable, "-m", "tests.gpu.host_memory_drill", "--api", str(api_json.resolve()), *cases]
    api = drill_runs.run_bounded(command, out / "host-memory-api.log", bound_s=API_BOUND_S, cwd=ROOT)
    if api_json.exists():
        report = json.loads(api_json.read_text())
        api_json.unlink()
    else:
        why = drill_runs.verdict("api", api) if api.stopped else f"exited {api.returncode}: {last_error_line(api.text)}"
        failure = {"passed": False, "failures": [f"the API cases did not finish: {why}"]}
        report = {"cases": {name: dict(failure) for name in cases}}
    for item in report["cases"].values():
        item["log"] = "host-memory-api.log"
    return report


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
