"""The pinning progress lines: what they say, and when they stay quiet."""

from __future__ import annotations

import io

import pytest
import torch

from megatron_offload.core.progress import GIB, pin_progress


def fake_clock(*readings: float):
    values = iter(readings)
    return lambda: next(values)


def test_pinning_says_how_much_how_long_and_how_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    with pin_progress(12 * GIB, stream=out, clock=fake_clock(100.0, 106.0)):
        assert out.getvalue() == "megatron-offload: pinning 12.00 GiB of host memory ...\n"  # before the wait
    assert out.getvalue().splitlines()[1] == (
        "megatron-offload: pinning 12.00 GiB of host memory ... done in 6.0 s (2.0 GiB/s)"
    )


@pytest.mark.parametrize(("nbytes", "rank"), [(GIB // 8, "0"), (12 * GIB, "1")])
def test_quiet_for_small_slabs_and_other_ranks(monkeypatch: pytest.MonkeyPatch, nbytes: int, rank: str) -> None:
    monkeypatch.setenv("RANK", rank)
    out = io.StringIO()
    with pin_progress(nbytes, stream=out, clock=fake_clock(0.0, 1.0)):
        pass
    assert out.getvalue() == ""


def test_no_done_line_when_pinning_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    with pytest.raises(RuntimeError), pin_progress(2 * GIB, stream=out, clock=fake_clock(0.0, 1.0)):
        raise RuntimeError("cudaHostRegister failed")
    assert out.getvalue() == "megatron-offload: pinning 2.00 GiB of host memory ...\n"


def test_a_slab_made_with_announce_off_pins_without_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_offload.core import host_memory

    monkeypatch.setattr(host_memory, "_cuda_available", lambda: True)
    monkeypatch.setattr(host_memory, "_pin", lambda pointer, nbytes: 0)
    monkeypatch.setattr(host_memory, "_unregister", lambda pointer: None)
    quiet = host_memory.HostSlab(host_memory.MIN_BYTES, torch.uint8, pin=True, announce=False)
    assert quiet.pinned and capsys.readouterr().err == ""
    loud = host_memory.HostSlab(host_memory.MIN_BYTES, torch.uint8, pin=True)
    assert loud.pinned and "pinning 0.25 GiB of optimizer state's host memory" in capsys.readouterr().err
