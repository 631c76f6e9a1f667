"""Environments of multi-turn rollouts."""
