"""Prefect flows: `train_flow` (the whole run), `episode_flow` (one episode), `eval_flow`, and their stage tasks."""

from flows.episode_flow import episode_flow
from flows.eval_flow import eval_flow
from flows.train_flow import train_flow

__all__ = ["episode_flow", "eval_flow", "train_flow"]
