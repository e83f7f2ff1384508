"""Weight streaming: every transformer layer's weights and gradients in host memory, streamed through GPU slots."""

__all__ = [
    "plan",
    "slots",
    "stats",
    "streamer",
]
