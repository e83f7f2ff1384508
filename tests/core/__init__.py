"""CPU tests of core/: copies, streams, host memory, progress."""
