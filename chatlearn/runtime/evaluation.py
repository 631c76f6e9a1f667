"""Eval results: per-sample records from the evaluator's batches, and the metrics the config's hook makes."""

from typing import Any

import torch

from chatlearn.data.batch import split_batch
from chatlearn.data.relay import load_hook

__all__ = ["default_eval_metrics", "eval_metrics", "eval_results"]


def eval_results(batches: list[Any]) -> list[dict[str, Any]]:
    """One dict per eval sample, with its scalar fields (text, score, ...) and no per-token tensors."""
    results = []
    for batch in batches:
        for sample in split_batch(batch):
            results.append({k: (v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v)
                            for k, v in sample.items() if not isinstance(v, torch.Tensor) or v.dim() == 0})
    return results


def default_eval_metrics(results: list[dict[str, Any]], context: dict[str, Any]) -> dict[str, Any]:
    """Mean score over the eval set (the post-processing used when no hook is configured)."""
    scores = [float(r["scores"]) for r in results if "scores" in r]
    return {"eval_reward_mean": sum(scores) / len(scores) if scores else None}


def eval_metrics(results: list[dict[str, Any]], context: dict[str, Any], hook: str | None) -> dict[str, Any]:
    """The default metrics, updated with what `runtime.eval_post_process_fn` (if any) returns."""
    metrics = default_eval_metrics(results, context)
    if hook:
        metrics.update(load_hook(hook)(results, context))
    return metrics
