"""CPU tests of megatron/: the adapter, pacing hooks, training hooks, sleep hooks."""
