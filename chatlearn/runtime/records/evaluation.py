"""Eval results: per-sample records from the evaluator's batches, and the metrics the config's hook makes."""

from typing import Any

import torch

from chatlearn.data.batch import split_batch
from chatlearn.data.relay import load_hook
from chatlearn.utils.errors import RunError
from chatlearn.utils.finite import one_line

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
    """The default metrics, updated with what `runtime.eval_post_process_fn` (if any) returns.

    The hook is user code: when it raises or returns something other than a dict of metrics by name, that is a
    RunError naming the hook (one line on the terminal; its traceback goes to the run's log), not a traceback
    from inside the eval stage. A non-finite metric it returns is not an error: nothing trains on it, and
    `metrics.jsonl` writes it as null."""
    metrics = default_eval_metrics(results, context)
    if hook:
        try:
            extra = load_hook(hook)(results, context)
        except Exception as exc:
            raise RunError(f"eval hook {hook} raised {type(exc).__name__}: {one_line(exc)} (on {len(results)} eval "
                           "results)") from exc
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise RunError(f"eval hook {hook} must return a dict of metrics by name, got "
                           f"{one_line(repr(extra), 80)}")
        metrics.update(extra)
    return metrics
