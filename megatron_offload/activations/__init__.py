"""Activation memory: what the forward keeps for the backward, and where it lives."""
