"""Events for CPU tests of the copy machinery: they complete only when a test opens them."""

from __future__ import annotations


class Gate:
    """An event that completes when opened (or fails when told to)."""

    def __init__(self) -> None:
        self.open = False
        self.error: str | None = None

    def query(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return self.open

    def synchronize(self) -> None:
        if self.error:
            raise RuntimeError(self.error)
        self.open = True  # a host wait: the device gets there
