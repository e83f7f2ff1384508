"""CPU tests of sleep/: sleep and wake without Megatron."""
