"""benchmarks/phase_probes.py and the stolen-time reading without a GPU: after each step, what the last backward
brought back and what bounded it, read from the real backward pacer (its handle the backward tests' ledger, its
memory readings the test's), and that line's summary; the machine's stolen time from a /proc/stat of the test's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks import phase_lines, phase_probes
from megatron_offload.core.units import GIB
from megatron_offload.megatron import backward_prefetch, finalize_prefetch
from tests.megatron.test_backward_prefetch import RETRIES, Memory, Retrying


def test_stolen_time_is_the_first_lines_eighth_value_in_milliseconds(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 5 0 3 250 0 0\ncpu0 50 0 25 500 2 0 1 125 0 0\n")
    assert phase_lines.stolen_ms(stat) == pytest.approx(250 * 1e3 / os.sysconf("SC_CLK_TCK"))
    stat.write_text("cpu  100 0 50 1000\n")  # a kernel that counts no stolen time
    assert phase_lines.stolen_ms(stat) == 0.0
    assert phase_lines.stolen_ms(tmp_path / "missing") == 0.0
    assert phase_lines.COUNTED[8] == "stolen ms"  # read by position in the allocator line


def test_the_threads_usage_is_its_own_and_grows_with_its_page_faults() -> None:
    before = phase_lines.thread_usage()
    step = os.sysconf("SC_PAGE_SIZE")
    pages = bytearray(64 << 20)  # 64 MiB of new pages, each written once by this thread
    pages[::step] = b"x" * (len(pages) // step)
    after = phase_lines.thread_usage()
    assert after[1] > before[1] and after[0] >= before[0] and after[2] >= before[2]


def test_each_step_says_what_the_last_backward_brought_back_and_what_bounded_it(monkeypatch) -> None:
    """One last backward an iteration brings back all 8 GiB moving until the allocator retried twice in each of
    two of them: from then on it is limited to what coming back early is worth (``BACK_EARLY_OVER_LEFT`` times the
    1 GiB the step leaves to the forward), and the lines say so, with the bytes started back as each backward
    ended."""
    # Restored after the test: note_bring_back replaces them for the rest of a process.
    monkeypatch.setattr(backward_prefetch.PrefetchDuringBackward, "new_iteration",
                        backward_prefetch.PrefetchDuringBackward.new_iteration)  # fmt: skip
    monkeypatch.setattr(finalize_prefetch, "bring_back_for_step", lambda handle: 3 * GIB)  # the handle's, here
    said: list[str] = []
    phase_probes.note_bring_back(said.append)
    monkeypatch.setitem(RETRIES, "count", 0)
    Memory(2 * GIB).install(monkeypatch)  # its readings count RETRIES
    ledger = Retrying()
    param, hooks = torch.nn.Parameter(torch.zeros(2)), ledger.pacer()  # the gradient the hooks are told of

    def iteration(retried: int = 0) -> None:
        hooks.on_grad_ready(param)  # one backward per iteration, each the last
        RETRIES["count"] += retried
        hooks.on_backward_done()
        finalize_prefetch.bring_back_for_step(ledger)  # as the handle starts the rest back once backward is done
        hooks.on_step_start()
        hooks.new_iteration()

    iteration()  # learns the backwards per iteration: nothing moving is known yet, no line
    assert said == []
    iteration()  # learns what the backward and the step hold
    assert said[-1].startswith(f"{phase_probes.BRING_BACK_PREFIX} hooks 0, as it ended 3072, of 8192 moving;")
    assert said[-1].endswith("limited False, stopped False, learned True")
    iteration(retried=2)
    iteration(retried=2)
    assert "hooks 8192," in said[-1] and said[-1].endswith("limited True, stopped False, learned True")
    iteration()
    worth = int(1024 * backward_prefetch.BACK_EARLY_OVER_LEFT)  # MiB, whole chunks of 512 here
    assert worth % 512 == 0 and f"hooks {worth}," in said[-1] and f"worth {worth};" in said[-1]
    summary = phase_probes.bring_back_summary("\n".join(said), skip=2)
    assert summary == (
        f"back during the last backward {(8192 + worth) // 2} MiB, as it ended 3072 MiB (medians of 2 iterations); "
        "limited in 2, stopped in 0"
    )
    assert phase_probes.bring_back_summary("no such lines") == ""
