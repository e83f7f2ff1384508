"""The verdict of a crash entry: the offloaded run, killed and resumed, against the uninterrupted
offloaded run, bitwise (every logged loss and grad norm after the load, every tensor of the final
checkpoints: parameters, Adam state, everything megatron-core saves), read beside its control: the same
kill at the same point in a run without offloading, resumed the same way, against its own uninterrupted
run.

A difference of the offloaded resume is
- megatron-core's when the control shows it too (the same logged value or checkpoint key differs there):
  megatron-core's own resume does it, with or without offloading; reported as such, neither a pass nor a
  failure of ours. Unless both uninterrupted runs agree there and the two resumes do not: then offloading
  changed what the resume did, a failure;
- a failure when the control does not show it (or there is no control to ask).
A difference of the control alone is reported, and is not ours. The entry's status: ``FAIL`` when any
failure remains (a difference of ours, or a run or check that went wrong), else ``megatron-core's
difference`` when there is one, else ``pass``.

Every resume has one such difference: Megatron-LM logs the loss of a process's second iteration as the
mean of its first two (``training_log`` in megatron/training/training.py, megatron-core 0.19.2, keeps the
loss sums of a process's first iteration: ``should_reset = not is_first_iteration``), so the second
iteration after a resume logs another loss than the uninterrupted run, whose first iteration was long
before; its grad norm, and every later loss, are equal. No Megatron setting changes this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.drills.drill_checkpoints import ABSENT, losses_and_grad_norms, tensor_differences

PASS, MEGATRON_CORE, FAIL = "pass", "megatron-core's difference", "FAIL"
Differences = dict[str, tuple[str, str]]  # what differs -> (its value uninterrupted, resumed)
SHOWN = 6  # differences named in a verdict line (all of them are in the entry's JSON)


def logged_differences(uninterrupted: str, resumed: str, iterations: list[int]) -> Differences:
    """Each loss and grad norm the resumed run logged otherwise than the uninterrupted one, as printed."""
    before, after = losses_and_grad_norms(uninterrupted), losses_and_grad_norms(resumed)
    found: Differences = {}
    for i in iterations:
        for k, label in enumerate(("lm loss", "grad norm")):
            want, got = before.get(i, (ABSENT, ABSENT))[k], after.get(i, (ABSENT, ABSENT))[k]
            if want != got:
                found[f"iteration {i} {label}"] = (want, got)
    return found


def checkpoint_differences(uninterrupted: dict[str, str], resumed: dict[str, str]) -> Differences:
    """Each tensor of the final checkpoints that differs, from their fingerprints (drill_checkpoints)."""
    return {f"final checkpoint {key}": pair for key, pair in tensor_differences(uninterrupted, resumed).items()}


def describe(what: str, pair: tuple[str, str]) -> str:
    return f"{what}: {pair[0]} uninterrupted, {pair[1]} resumed"


@dataclass
class Verdict:
    """A crash entry's outcome: its status and every difference, sorted by whose it is."""

    status: str
    failures: list[str] = field(default_factory=list)  # ours, or the drill's: what fails the entry
    megatron_core: list[str] = field(default_factory=list)  # shown by the control as well: megatron-core's
    control_only: list[str] = field(default_factory=list)  # the control's alone: not ours, reported

    def line(self) -> str:
        """The verdict in one line, as the table and the log print it."""
        if self.status == PASS:
            return "pass: the resumed run is bitwise the uninterrupted one"
        items = self.failures if self.status == FAIL else self.megatron_core
        more = f" (and {len(items) - SHOWN} more)" if len(items) > SHOWN else ""
        return f"{self.status}: " + "; ".join(items[:SHOWN]) + more


def judge(ours: Differences, control: Differences | None, failures: list[str] | None = None) -> Verdict:
    """Sort the offloaded resume's differences by the control's (None: no control could be read); the
    ``failures`` already found (runs, kill point, tracker, loaded iteration) fail the entry as they are."""
    verdict = Verdict(PASS, list(failures or []))
    for what, pair in ours.items():
        if control is None:
            verdict.failures.append(describe(what, pair) + " (no control to tell whose)")
        elif what not in control:
            verdict.failures.append(describe(what, pair) + "; the run without offloading resumed equal")
        elif control[what][0] == pair[0] and control[what][1] != pair[1]:
            verdict.failures.append(
                describe(what, pair) + f"; without offloading the same start resumed to {control[what][1]}"
            )
        else:
            verdict.megatron_core.append(describe(what, pair) + "; the same without offloading")
    for what, pair in (control or {}).items():
        if what not in ours:
            verdict.control_only.append(describe(what, pair) + " (without offloading only)")
    verdict.status = FAIL if verdict.failures else MEGATRON_CORE if verdict.megatron_core else PASS
    return verdict
