"""CPU tests of activations/."""
