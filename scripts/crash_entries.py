"""The crash entries of scripts/integration.py, and the bounded runner every drill's child runs under.

A crash entry: a run with offloading killed with SIGKILL at a chosen moment (tests/gpu/crash_driver.py),
then a new process that loads the last complete checkpoint and runs on; both compared with an
uninterrupted run of the same flags.

Per entry (``crash-after-step``, ``crash-backward``, ``crash-checkpoint``), checks: the kill happened
where asked (after-step: with copies to host still pending); ``latest_checkpointed_iteration.txt`` names
the last save before the kill, and that save is complete (its ``.metadata`` written); a save cut short
by the kill (crash-checkpoint) is left without its ``.metadata`` and is not what the resumed run loads;
the resumed run says it loaded the last complete iteration; its grad norms and losses equal the
uninterrupted run's as printed (but for the second loss after the load, which Megatron prints as the mean
of the first two: its training_log keeps its sums after a run's first iteration); and every tensor of
both final checkpoints (parameters and Adam state, converted with ``dcp_to_torch_save``) is bitwise equal.
The uninterrupted run is made once per invocation, beside the first entry's killed run.

Why a bounded runner. An unbounded runner never comes back from a killed run: megatron-core 0.19's
torch_dist save starts a ``multiprocessing`` Manager process (spawned, for its write results) and its
resource tracker (on an H100, torch inductor's compile worker too); a process killed with SIGKILL runs
no finalizer, so they outlive it, holding the stdout pipe that ``subprocess.run(capture_output=True)``
read to its end, and torchrun starts its workers in a process group of their own (setsid), so nothing
that signals torchrun's group reaches them. Here every run writes its log straight to a file (a leftover
process cannot hold the drill), has a time bound, and carries a token in its environment by which every
process it started is found and killed: at the bound (the whole process group and every process with the
token, whatever process group it moved to), and after it ended (what it left behind, reported). A run
stopped at a bound ends its entry with a verdict naming the run, its phase and its last log lines.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CRASH_DRIVER = "tests/gpu/crash_driver.py"
CRASH_MARKER = "megatron-offload crash drill: SIGKILL"
NEVER_REACHED = "never reached the"  # crash_driver.py's line when training ended before the kill point
TRAIN_ITERS, SAVE_INTERVAL = 20, 5
KILL_AT = {"after-step": 13, "backward": 13, "checkpoint": 15}  # the iteration of each kill
ENTRY_BUDGET_S = 180.0  # each entry in under 3 minutes on one H100
ARGS = [
    *("--config", "configs/tiny.yaml", "--train-iters", str(TRAIN_ITERS), "--log-memory-interval", str(TRAIN_ITERS)),
    *("--offload-optimizer-states", "--ckpt-format", "torch_dist", "--save-interval", str(SAVE_INTERVAL)),
]
RUN_TOKEN = "MEGATRON_OFFLOAD_DRILL_RUN"  # in every bounded run's environment, inherited by its processes
_STEP = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
_ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \|")
_LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")


# ------------------------------------------------------------------------------------ bounded runs
@dataclass(frozen=True)
class Bounds:
    """How long a drill waits. A run past ``run_s`` is killed with everything it started."""

    run_s: float = 150.0  # any one run, start to exit (a tiny.yaml run takes about 30 s on an H100)
    after_kill_s: float = 45.0  # the killed run, from its SIGKILL line to its exit (torchrun notices in ~1 s)
    linger_s: float = 5.0  # processes a run leaves behind get this long to end by themselves


@dataclass
class Outcome:
    """How one bounded run ended."""

    returncode: int | None  # None: stopped by the drill before it ended
    seconds: float
    stopped: str | None  # why the drill stopped it (a bound, a watch's reason); None when it ended by itself
    left_behind: list[str] = field(default_factory=list)  # its processes alive after it ended ("pid command")
    killed: list[str] = field(default_factory=list)  # what the drill killed when it stopped the run
    text: str = ""


Watch = Callable[[str, float], str | None]  # (log so far, seconds since start) -> a reason to stop it now


_live: dict[str, int] = {}  # runs under way: token -> pid (their process group), for kill_live_runs()


def kill_live_runs() -> None:
    """Kill every run under way, with everything it started (a drill on its way out leaves none behind)."""
    for token, pid in list(_live.items()):
        kill_run(pid, token)


def exit_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a scheduler) end the drill with its runs killed: by default Python dies at
    once and leaves the runs under way (each in a process group of its own) behind."""

    def stop(signum: int, frame: Any) -> None:
        kill_live_runs()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def run_bounded(
    command: list[str],
    log_path: Path,
    *,
    bound_s: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    watch: Watch | None = None,
    linger_s: float = 5.0,
    poll_s: float = 0.2,
) -> Outcome:
    """Run ``command`` with its output in ``log_path``; never wait past ``bound_s`` (plus the seconds a
    SIGKILL takes). The log is a file, not a pipe: a descendant that outlives the run cannot hold us."""
    token = uuid.uuid4().hex
    full_env = {**(os.environ if env is None else env), RUN_TOKEN: token, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    stopped = None
    killed: list[str] = []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as one at a bound
        )
        _live[token] = process.pid
        try:
            reader = _LogReader(log_path)
            while process.poll() is None:
                elapsed = time.monotonic() - start
                if elapsed > bound_s:
                    stopped = f"no exit within {bound_s:g} s"
                    break
                reason = watch(reader.read(), elapsed) if watch is not None else None
                if reason:
                    stopped = reason
                    break
                time.sleep(poll_s)
        finally:
            if process.poll() is None:  # at a bound, or the drill itself is being interrupted
                killed = kill_run(process.pid, token)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:  # unkillable (a process stuck in the kernel): say so
                    stopped = f"{stopped or 'stopped'}; still not gone 30 s after SIGKILL"
            _live.pop(token, None)
    left_behind = _reap_leftovers(token, linger_s) if stopped is None else []
    text = log_path.read_text(errors="replace")
    returncode = None if stopped else process.poll()
    return Outcome(returncode, time.monotonic() - start, stopped, left_behind, killed, text)


class _LogReader:
    """The log so far, read incrementally (a watch looks at it several times a second)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.text = path, 0, ""

    def read(self) -> str:
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            chunk = file.read()
        self.offset += len(chunk)
        self.text += chunk.decode(errors="replace")
        return self.text


def processes_of(token: str) -> list[int]:
    """Live processes whose environment carries this run's token (Linux /proc; empty elsewhere)."""
    needle = f"{RUN_TOKEN}={token}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environment = (entry / "environ").read_bytes()
        except OSError:  # gone, a zombie, or not ours
            continue
        if needle in environment.split(b"\0") and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return sorted(found)


def _descendants(pid: int) -> list[int]:
    """Children of ``pid`` and theirs, from /proc (a process that dropped its environment too)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def describe(pid: int) -> str:
    """``pid command line`` (shortened), or ``pid`` alone when it is gone."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"{pid} {command[:160]}".strip()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead: only its parent's wait is missing


def kill_run(pgid: int, token: str) -> list[str]:
    """SIGKILL a run's process group, its descendants and every process with its token, until none is
    left (a process may fork while we look). Returns what was signalled, as ``pid command``."""
    signalled: dict[int, str] = {}
    for _ in range(5):
        targets = {pid for pid in [*_descendants(pgid), *processes_of(token)] if _alive(pid)} - signalled.keys()
        if pgid not in signalled and _alive(pgid):
            targets.add(pgid)
        signalled |= {pid: describe(pid) for pid in targets}
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if not targets:
            break
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    deadline = time.monotonic() + 5  # gone, not only signalled: a run after this one starts clean
    while any(_alive(pid) for pid in signalled) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [signalled[pid] for pid in sorted(signalled)]


def _reap_leftovers(token: str, linger_s: float) -> list[str]:
    """Processes the run left behind: given ``linger_s`` to end by themselves, then killed."""
    deadline = time.monotonic() + linger_s
    left = [pid for pid in processes_of(token) if _alive(pid)]
    described = {pid: describe(pid) for pid in left}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [pid for pid in left if _alive(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5  # a SIGKILL takes effect at once, but not within the same instant
    while any(_alive(pid) for pid in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [described[pid] for pid in left]


def last_iteration(text: str) -> int | None:
    """The last iteration Megatron logged, or None before the first."""
    found = _ITERATION.findall(text)
    return int(found[-1]) if found else None


def phase(text: str) -> str:
    """Where a Megatron run was, from its log: what a verdict names."""
    iteration = last_iteration(text)
    where = f"after iteration {iteration}" if iteration is not None else "before its first iteration"
    if CRASH_MARKER in text:
        return f"{where}, after its SIGKILL line"
    loaded = _LOADED.findall(text)
    if loaded and iteration is None:
        return f"after loading the checkpoint of iteration {loaded[-1]}, before its first iteration"
    return where


def tail(text: str, lines: int = 5) -> str:
    """The last non-empty log lines, joined on one line."""
    kept = [line.strip()[:240] for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "(empty log)"


def verdict(name: str, outcome: Outcome) -> str:
    """One sentence for a run the drill had to stop: which run, why, where, what it said last."""
    where, last = phase(outcome.text), tail(outcome.text)
    return f"{name} run stopped by the drill: {outcome.stopped} ({where}); last log lines: {last}"


# --------------------------------------------------------------------------------- what is read
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


def checkpoint_tensors(iteration_dir: Path, scratch: Path) -> dict[str, Any]:
    """Every item of a torch_dist checkpoint, by flattened key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{iteration_dir.parent.name}-{iteration_dir.name}.pt"
    dcp_to_torch_save(iteration_dir, target)
    try:
        return flatten(torch.load(target, weights_only=False))
    finally:
        target.unlink(missing_ok=True)  # 400 MB a checkpoint of tiny.yaml: the comparison needs them in memory only


def flatten(item: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(item, dict):
        return {k: v for key, value in item.items() for k, v in flatten(value, f"{prefix}{key}/").items()}
    if isinstance(item, list | tuple):
        return {k: v for i, value in enumerate(item) for k, v in flatten(value, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): item}


def compare_checkpoints(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, list[str]]:
    """Tensors compared, and every difference (a key on one side only, dtype, shape, any bit)."""
    import torch

    differences = [f"{key}: only in one checkpoint" for key in sorted(a.keys() ^ b.keys())]
    compared = 0
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            compared += 1
            same = x.dtype == y.dtype and x.shape == y.shape
            # Bitwise, not numerically: NaNs of the same bits are equal, -0.0 and 0.0 are not.
            if not same or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                differences.append(f"{key}: differs ({x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)})")
        elif isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            differences.append(f"{key}: a tensor in one checkpoint only")
    return compared, differences


# ---------------------------------------------------------------------------------- the entries
def killed_run_watch(mode: str, kill_at: int, after_kill_s: float) -> Watch:
    """Stop the killed run as soon as it cannot end well: it logged an iteration past its kill point
    (the kill will never come), or its SIGKILL line is ``after_kill_s`` old and it has not ended
    (torchrun waiting for a dead child, or a process that survived the kill)."""
    seen: list[float] = []

    def watch(text: str, elapsed: float) -> str | None:
        if CRASH_MARKER in text:
            seen[:] = seen or [elapsed]
            if elapsed - seen[0] > after_kill_s:
                return f"its SIGKILL came {seen[0]:.0f} s in, and it had not ended {after_kill_s:g} s later"
            return None
        iteration = last_iteration(text)
        if iteration is not None and iteration > kill_at:
            return (
                f"it never reached its kill point ({mode} of iteration {kill_at}): iteration {iteration} "
                "logged with no SIGKILL"
            )
        return None

    return watch


class CrashDrill:
    """The crash entries of one invocation: they share the uninterrupted run (made once) and a scratch
    directory for checkpoints. ``launcher`` starts a run (torchrun on a GPU machine; the CPU tests give
    a plain interpreter and a stand-in ``driver``); ``parse`` adds what integration.py reads from a log."""

    def __init__(
        self,
        out: Path,
        launcher: list[str],
        bounds: Bounds = Bounds(),
        *,
        driver: str = CRASH_DRIVER,
        args: list[str] | None = None,
        cwd: Path | None = None,
        parse: Callable[[str], dict] = lambda text: {},
    ) -> None:
        self.out, self.launcher, self.bounds, self.driver = out, launcher, bounds, driver
        self.args = list(ARGS if args is None else args)
        self.cwd, self.parse = cwd, parse
        self.scratch = Path(tempfile.mkdtemp(prefix="offload-crash-"))
        self.reference: dict[str, Any] | None = None

    def close(self) -> None:
        """Remove the checkpoints (several GB over three entries)."""
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _run(
        self, name: str, run_name: str, argv: list[str], env: dict[str, str], watch: Watch | None = None
    ) -> tuple[dict, str]:
        """One bounded run: what integration.py reads from its log, how it ended; and the log."""
        log = self.out / f"{name}-{run_name}.log"
        print(f"[{name}/{run_name}] {' '.join(self.launcher + argv)}", flush=True)
        outcome = run_bounded(
            self.launcher + argv,
            log,
            bound_s=self.bounds.run_s,
            env={**os.environ, **env},
            cwd=self.cwd,
            watch=watch,
            linger_s=self.bounds.linger_s,
        )
        result = self.parse(outcome.text) | {
            "returncode": outcome.returncode,
            "seconds": round(outcome.seconds, 1),
            "stopped": outcome.stopped,
            "verdict": verdict(run_name, outcome) if outcome.stopped else None,
            "killed_at_bound": outcome.killed,
            "left_behind": outcome.left_behind,
        }
        ended = "stopped: " + outcome.stopped if outcome.stopped else f"exit {outcome.returncode}"
        print(f"[{name}/{run_name}] {ended} after {outcome.seconds:.0f} s", flush=True)
        return result, outcome.text

    def run_entry(
        self, name: str, mode: str, env: dict[str, str] | None = None
    ) -> tuple[dict[str, dict], list[str], dict]:
        """Uninterrupted (once per invocation), killed, resumed: their results, failures and what was seen."""
        start = time.monotonic()
        env = dict(env or {})
        kill_at = KILL_AT[mode]
        reference = None
        if self.reference is None:
            # Made once per invocation, beside the first killed run (a tiny.yaml run spends most of its
            # minute starting up, and the two need well under 2 GiB of the GPU): the first entry then
            # takes two runs' time, not three.
            reference_dir = self.scratch / "uninterrupted"
            made: dict[str, Any] = {"dir": reference_dir, "entry": name}

            def make_reference(argv: list[str]) -> None:
                try:
                    made["result"], made["text"] = self._run(name, "uninterrupted", argv, env)
                except Exception as error:  # the entry's verdict says so; the thread must not die silently
                    why = f"the drill could not run it: {type(error).__name__}: {error}"
                    made["result"], made["text"] = {"returncode": None, "stopped": why, "left_behind": []}, ""

            argv = [self.driver, *self.args, "--save", str(reference_dir)]
            reference = threading.Thread(target=make_reference, args=(argv,), daemon=True)
            reference.start()
        save_dir = self.scratch / mode
        crash_env = {**env, "OFFLOAD_CRASH_AT": mode, "OFFLOAD_CRASH_ITERATION": str(kill_at)}
        watch = killed_run_watch(mode, kill_at, self.bounds.after_kill_s)
        argv = [self.driver, *self.args, "--save", str(save_dir)]
        try:
            killed = self._run(name, "killed", argv, crash_env, watch)
            if reference is not None:
                reference.join()
                self.reference = made
        except BaseException:
            kill_live_runs()  # the reference too, should it still run
            raise
        runs = {"uninterrupted": self.reference["result"]}
        logs = {"uninterrupted": self.reference["text"]}
        runs["killed"], logs["killed"] = killed
        facts: dict[str, Any] = {
            "tracker_after_kill": last_complete_iteration(save_dir),
            "cut_short_after_kill": cut_short(save_dir),
            "left_behind_by_kill": runs["killed"]["left_behind"],
        }
        if self.reference["entry"] != name:
            facts["uninterrupted_run_of"] = self.reference["entry"]
        argv = [self.driver, *self.args, "--save", str(save_dir), "--load", str(save_dir)]
        runs["resumed"], logs["resumed"] = self._run(name, "resumed", argv, env)
        failures = check(mode, kill_at, runs, logs, facts, save_dir)
        if not failures:
            final = f"iter_{TRAIN_ITERS:07d}"
            if "tensors" not in self.reference:  # read once, compared with every entry's
                self.reference["tensors"] = checkpoint_tensors(self.reference["dir"] / final, self.scratch)
            a = self.reference["tensors"]
            b = checkpoint_tensors(save_dir / final, self.scratch)
            facts["tensors_compared"], differences = compare_checkpoints(a, b)
            failures += [f"final checkpoints: {d}" for d in differences[:20]]
            if not facts["tensors_compared"]:
                failures.append("final checkpoints: no tensors found to compare")
        facts["entry_seconds"] = round(time.monotonic() - start, 1)
        if facts["entry_seconds"] > ENTRY_BUDGET_S:
            failures.append(f"the entry took {facts['entry_seconds']:.0f} s, over its {ENTRY_BUDGET_S:.0f} s")
        return runs, failures, facts


def check(
    mode: str, kill_at: int, results: dict, logs: dict[str, str], facts: dict, save_dir: Path | None = None
) -> list[str]:
    """Failures of a crash entry before its checkpoints are compared, as sentences."""
    failures = []
    for name in ("uninterrupted", "resumed"):
        result = results[name]
        if result.get("stopped"):
            failures.append(result.get("verdict") or f"{name} run stopped by the drill: {result['stopped']}")
        elif result["returncode"]:
            failures.append(f"{name} exited {result['returncode']}: {tail(logs[name], 2)}")
    killed = results["killed"]
    marker = next((line for line in logs["killed"].splitlines() if CRASH_MARKER in line), None)
    facts["kill"] = marker
    expected = (kill_at - 1) // SAVE_INTERVAL * SAVE_INTERVAL  # the last save before the kill
    if killed.get("stopped"):
        failures.append(killed.get("verdict") or f"killed run stopped by the drill: {killed['stopped']}")
    elif marker is None:
        where = last_iteration(logs["killed"])
        ran = f"ended after iteration {where}" if where is not None else "ended before its first iteration"
        ran = "ran to its end" if NEVER_REACHED in logs["killed"] else ran
        failures.append(
            f"killed run never reached its kill point ({mode} of iteration {kill_at}): it {ran}, "
            f"exit {killed['returncode']}; last log lines: {tail(logs['killed'], 3)}"
        )
    elif killed["returncode"] == 0:
        failures.append(f"killed run: its SIGKILL line was printed but it exited 0 ({marker})")
    if marker is not None and mode == "after-step":
        pending = re.search(r"pending copy-out bytes (\d+)", marker)
        if pending is None or int(pending[1]) <= 0:
            failures.append("killed: no copy to host was in flight at the kill")
    if facts["tracker_after_kill"] != expected:
        failures.append(
            f"after the kill the tracker names iteration {facts['tracker_after_kill']}, expected {expected}"
        )
    elif save_dir is not None:
        facts["tracker_names_complete_save"] = is_complete(save_dir / f"iter_{expected:07d}")
        if not facts["tracker_names_complete_save"]:
            failures.append(f"the tracker names iteration {expected}, whose save has no .metadata (incomplete)")
    wanted_cut = [f"iter_{kill_at:07d}"] if mode == "checkpoint" else []
    if facts["cut_short_after_kill"] != wanted_cut:
        failures.append(f"saves left incomplete by the kill: {facts['cut_short_after_kill']}, expected {wanted_cut}")
    loaded = [int(i) for i in _LOADED.findall(logs["resumed"])]
    facts["resumed_loaded"] = loaded
    if loaded != [expected]:
        failures.append(
            f"resumed: no 'successfully loaded checkpoint ... at iteration {expected}' in the log ({loaded})"
        )
    reference, resumed = losses_and_grad_norms(logs["uninterrupted"]), losses_and_grad_norms(logs["resumed"])
    wanted = list(range(expected + 1, TRAIN_ITERS + 1))
    if sorted(resumed) != wanted:
        failures.append(f"resumed: logged iterations {sorted(resumed)}, expected {wanted}")
    first = expected + 1
    for i in (i for i in wanted if i in resumed):
        loss, norm = resumed[i]
        want_loss, want_norm = reference.get(i, (None, None))
        if norm != want_norm:
            failures.append(f"iteration {i}: grad norm {norm} resumed, {want_norm} uninterrupted")
        if loss == want_loss:
            continue
        # Megatron's training_log does not reset its loss sums after a run's first iteration (should_reset =
        # not is_first_iteration): a resumed run's second line prints the mean of its first two losses.
        if i == first + 1 and is_mean(loss, reference.get(first, (None, None))[0], want_loss):
            facts["second_loss_after_load"] = "the mean of the first two, as Megatron's log accounts after a start"
            continue
        failures.append(f"iteration {i}: loss {loss} resumed, {want_loss} uninterrupted")
    facts["losses_after_load"] = {i: [resumed[i][0], reference.get(i, ("?",))[0]] for i in wanted[:2] if i in resumed}
    return failures


def is_mean(printed: str, a: str | None, b: str | None) -> bool:
    """``printed`` is the mean of ``a`` and ``b`` to the precision Megatron prints (7 significant digits)."""
    try:
        mean = (float(a) + float(b)) / 2  # type: ignore[arg-type]
        return abs(float(printed) - mean) <= 2e-6 * abs(mean)
    except (TypeError, ValueError):
        return False


def torchrun(gpus: int) -> list[str]:
    """The launcher of a GPU run: Megatron initializes torch.distributed from torchrun's environment."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
