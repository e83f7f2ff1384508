"""Optimizer-state offloading for any torch optimizer: plan, offloader, chunked step, schedule."""

__all__ = [
    "chunk_copies",
    "chunk_step",
    "offloader",
    "plan",
    "planned_state",
    "scheduler",
    "streamed_step",
]
