"""Prefect flows: `train_flow` (the whole run), `episode_flow` (one episode) and their stage tasks."""

from flows.episode import episode_flow
from flows.train import train_flow

__all__ = ["train_flow", "episode_flow"]
