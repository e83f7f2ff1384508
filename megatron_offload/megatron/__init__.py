"""Every touch of megatron-core and Megatron-LM: optimizer and weight adapters, training-loop hooks."""

__all__ = [
    "adam_resume",
    "finalize_prefetch",
    "kept_decision",
    "offload_handle",
    "optimizer_adapter",
    "optimizer_internals",
    "pacing",
    "report",
    "sleep_hooks",
    "training_hooks",
    "training_run",
    "weights_adapter",
    "weights_training",
]
