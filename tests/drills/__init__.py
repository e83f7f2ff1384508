"""The drills run on a GPU machine, and what judges them: integration runs, crash entries, bounded runs."""

__all__ = ["crash_checks", "crash_entries", "crash_verdict", "drill_checkpoints", "drill_runs", "integration"]
