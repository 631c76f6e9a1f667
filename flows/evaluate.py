"""The eval flow: a saved policy answers the eval set, the reward scores it, the post-processing hook sums up.

`chatlearn eval CONFIG models.policy.args_dict.model_path=output/default/final/policy` runs it (ChatLearn's
EvalEngine). Only the `policy` and `reward` models of the config are started.
"""

import json
import os
import sys
from typing import Any

from prefect import Flow

from chatlearn.runtime.engine import build_engine, load_run_config
from chatlearn.runtime.launch import launch
from chatlearn.utils.arguments import ChatLearnConfig, ConfigError
from flows.tasks import evaluate
from flows.train import ConfigParam


def _eval(config: ConfigParam, modules: dict[str, Any] | None = None) -> dict:
    """Evaluate once; writes `run_dir/eval.json` and returns the metrics."""
    cfg: ChatLearnConfig = config
    eng = build_engine(cfg, modules, "eval")
    if not cfg.runtime.get("eval_data_path"):
        raise ConfigError(["runtime.eval_data_path: evaluation needs an eval set (JSONL or JSON prompt file)"])
    seed = int(cfg.runtime.get("seed") or 42)
    with launch(cfg, eng, seed, with_train_data=False) as (run, _groups, _stream):
        result = evaluate(run, cfg, -1)
    metrics = dict(result["metrics"], eval_num_samples=run.eval_dataset_size, eval_seconds=result["seconds"],
                   model_path=(cfg.models[eng.plan.producer].args_dict or {}).get("model_path"))
    os.makedirs(cfg.runtime.run_dir, exist_ok=True)
    with open(os.path.join(cfg.runtime.run_dir, "eval.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    for ex in result["examples"][:3]:
        sys.stderr.write(f"    eval: {ex['prompt']!r} -> {ex['response']!r} (score {ex['score']})\n")
    return metrics


class _PrevalidatedEval(Flow):
    def __call__(self, config: Any, modules: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        cfg = load_run_config(config, None, modules)
        build_engine(cfg, modules, "eval")
        return super().__call__(cfg, modules=modules, **kwargs)


eval_flow = _PrevalidatedEval(fn=_eval, name="chatlearn-eval", log_prints=True)
