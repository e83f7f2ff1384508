"""The compute stream's waits, counted from their events once completed, never by a wait."""

from __future__ import annotations

from megatron_offload.core.stats import WaitClock


class Event:
    def __init__(self, at: float, done: bool = True) -> None:
        self.at, self.done = at, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: Event) -> float:
        return end.at - self.at


def test_completed_waits_count_and_running_ones_wait_for_a_later_reading() -> None:
    clock = WaitClock()
    running = Event(7.0, done=False)
    clock.add(Event(0.0), Event(1.5))
    clock.add(Event(5.0), running)
    clock.add(None, None)  # streams that do not time: nothing to count
    assert clock.read() == 1.5
    running.done = True
    assert clock.read() == 3.5 and clock.read() == 3.5  # each wait counted once


def test_pending_waits_stay_bounded_without_a_reader() -> None:
    clock = WaitClock(most_pending=4)
    for _ in range(100):
        clock.add(Event(0.0), Event(1.0))
        assert len(clock._pending) <= 4
    assert clock.read() == 100.0
