"""The eval flow: a saved policy answers the eval set, the reward scores it, the post-processing hook sums up.

`chatlearn eval CONFIG models.policy.args_dict.model_path=output/default/final/policy` runs it (ChatLearn's
EvalEngine). Only the `policy` and `reward` models of the config are started.

Continuous evaluation: `chatlearn deploy CONFIG --evaluate` also registers an eval deployment that an
automation starts whenever a run of the train deployment completes; it gets that run's id (`train_run`),
evaluates its `final/policy` and writes `eval/eval.json` into its run directory.
"""

import json
import os
import sys
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

from chatlearn.runtime.launch import launch
from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.prefect.prevalidated import ConfigParam, PrevalidatedFlow, config_of
from chatlearn.runtime.prepared import handed_down, prepare_run
from chatlearn.runtime.records.run_lock import lock_run_dir
from flows.model_calls import PrefectCalls
from flows.pins import check_run
from flows.stage_tasks import evaluate


def outputs_of_run(flow_run: str) -> dict[str, str]:
    """What a finished train flow run left (`run_dir`, `final_policy`), from its outputs artifact.

    `flow_run` is a flow run id or an event resource id (`prefect.flow-run.<id>`, what a trigger passes).
    """
    run_id = UUID(flow_run.removeprefix("prefect.flow-run."))
    flt = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(like_="%-outputs"))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=flt)
    if not found:
        raise ValueError(f"train_run: flow run {run_id} has no outputs artifact (not a completed chatlearn-train run)")
    data = found[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    return {row["output"]: row["path"] for row in rows}


@api_link.keeps_result  # its result survives the Prefect API failing to record the final state
def _eval(config: ConfigParam | None = None, config_path: str | None = None, overrides: list[str] | None = None,
          train_run: str | None = None, modules: dict[str, Any] | None = None) -> dict:
    """Evaluate once; writes `run_dir/eval.json` and returns the metrics.

    Args:
        config: the whole config (the run form of a deployment, pre-filled with its config)
        config_path: a YAML config instead of `config` (relative to the run's working directory); default:
            the embedded default
        overrides: dotted `key=value` overrides applied on top, e.g. `models.policy.args_dict.model_path=DIR`
        train_run: a completed train flow run (id or `prefect.flow-run.<id>`, what the completion trigger
            passes): its `final/policy` is evaluated and `eval.json` goes into its run directory's `eval/`
        modules: model objects by role (Python callers only)
    """
    check_run(config, config_path, overrides, modules=modules)  # a deployment's run: its code as deployed
    overrides = list(overrides or ())
    if train_run:
        outputs = outputs_of_run(train_run)
        if "final_policy" not in outputs:
            raise ValueError(f"train_run: {train_run} exported no final policy (its engine exports none)")
        overrides += [f"models.policy.args_dict.model_path={outputs['final_policy']}",
                      f"runtime.output_dir={outputs['run_dir']}", "runtime.exp_name=eval"]
    # a direct call prepared the run before the flow run existed (unless it evaluates a train run's policy)
    prepared = handed_down() or prepare_run(config_of(config, config_path, overrides, "eval", modules), modules,
                                            "eval")
    cfg, eng = prepared.cfg, prepared.engine
    # one command per run directory, as train (a RunError naming the holder): the eval of a train run locks that
    # run's directory, whose policy it reads and into which it writes; `chatlearn eval` holds its own already
    with lock_run_dir(outputs["run_dir"] if train_run else cfg.runtime.run_dir):
        with launch(prepared, PrefectCalls()) as ctx:
            result = evaluate(ctx, -1)
        metrics = dict(result["metrics"], eval_num_samples=ctx.eval_dataset_size, eval_seconds=result["seconds"],
                       model_path=(cfg.models[eng.plan.producer].args_dict or {}).get("model_path"))
        os.makedirs(cfg.runtime.run_dir, exist_ok=True)
        with open(os.path.join(cfg.runtime.run_dir, "eval.json"), "w") as f:
            json.dump(metrics, f, indent=1)
    for ex in result["examples"][:3]:
        sys.stderr.write(f"    eval: {ex['prompt']!r} -> {ex['response']!r} (score {ex['score']})\n")
    return metrics


eval_flow = PrevalidatedFlow(fn=_eval, engine="eval", prepares_inside_with="train_run", name="chatlearn-eval",
                             log_prints=True)
