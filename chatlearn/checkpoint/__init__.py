"""Checkpoints: model state saved by each trainable actor, and the run's data checkpoint record."""
