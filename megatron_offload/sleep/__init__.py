"""Sleep and wake: hand a training job's GPU memory to someone else between training phases (RL)."""

__all__ = [
    "parked_buffers",
    "parts",
    "report",
    "sleeper",
]
