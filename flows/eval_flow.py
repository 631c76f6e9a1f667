"""The eval flow: a saved policy answers the eval set, the reward scores it, the post-processing hook sums up.

`chatlearn eval CONFIG models.policy.args_dict.model_path=output/default/final/policy` runs it (ChatLearn's
EvalEngine). Only the `policy` and `reward` models of the config are started.
"""

import json
import os
import sys
from typing import Any

from chatlearn.config import ChatLearnConfig
from chatlearn.runtime.launch import launch
from chatlearn.runtime.plan import resolve_engine
from flows.prevalidated import ConfigParam, PrevalidatedFlow
from flows.stage_tasks import evaluate


def _eval(config: ConfigParam, modules: dict[str, Any] | None = None) -> dict:
    """Evaluate once; writes `run_dir/eval.json` and returns the metrics."""
    cfg: ChatLearnConfig = config
    eng = resolve_engine(cfg, modules, "eval")  # raises ConfigError before any actor exists
    with launch(cfg, eng) as (run, _groups, _stream):
        result = evaluate(run, -1)
    metrics = dict(result["metrics"], eval_num_samples=run.eval_dataset_size, eval_seconds=result["seconds"],
                   model_path=(cfg.models[eng.plan.producer].args_dict or {}).get("model_path"))
    os.makedirs(cfg.runtime.run_dir, exist_ok=True)
    with open(os.path.join(cfg.runtime.run_dir, "eval.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    for ex in result["examples"][:3]:
        sys.stderr.write(f"    eval: {ex['prompt']!r} -> {ex['response']!r} (score {ex['score']})\n")
    return metrics


eval_flow = PrevalidatedFlow(fn=_eval, engine="eval", name="chatlearn-eval", log_prints=True)
