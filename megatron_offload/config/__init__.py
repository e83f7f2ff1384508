"""Settings and their sources: ``OffloadConfig``, the command-line flags and their checks, ``--config`` YAML files."""

__all__ = [
    "files",
    "flags",
    "options",
    "weight_flags",
]
