"""Bring a run's actors up and down: Ray, the model actors, the StreamDataset, the prompt datasets.

Shared by the train and eval flows. The flow process is the Ray driver; actors are created here (never in a
task: an actor created inside a task dies with it) and killed on the way out, failures included.
"""

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import ray

from chatlearn.data.prompts import DataError, load_records
from chatlearn.runtime.engine import Engine
from chatlearn.runtime.handles import RunHandle
from chatlearn.runtime.model_group import ModelGroup, create_model_group, required_cpus
from chatlearn.runtime.stream_dataset import StreamDataset
from chatlearn.utils.arguments import ChatLearnConfig

logger = logging.getLogger("chatlearn")


def init_ray(cfg: ChatLearnConfig, namespace: str) -> bool:
    """Join `RAY_ADDRESS` (or an already initialized Ray), else start a local Ray sized for the models.

    Returns whether this call started Ray (and so must shut it down). A local Ray gets at least as many
    logical CPUs as the model actors ask for, so the default six CPU models schedule on a 2-core machine.
    """
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    common: dict[str, Any] = dict(namespace=namespace, log_to_driver=False, configure_logging=False)
    if address:
        env = cfg.runtime_env
        runtime_env: dict[str, Any] = {}
        if env.pip:
            runtime_env["pip"] = list(env.pip)
        if env.py_modules:
            runtime_env["py_modules"] = list(env.py_modules)
        if env.working_dir and cfg.runtime_env.get("upload_working_dir"):
            runtime_env["working_dir"] = env.working_dir
            runtime_env["excludes"] = list(env.excludes) + [".venv", ".git", "output"]
        ray.init(address=address, runtime_env=runtime_env or None, **common)
        return True
    # Logical CPUs: what the actors ask for, plus room for the dispatch tasks' worker processes. Ray keeps
    # at most `num_cpus` idle workers; fewer would make it kill and re-spawn them (seconds of imports) often.
    cpus = max(os.cpu_count() or 1, int(required_cpus(cfg.models) + 0.999) + 4)
    ray.init(num_cpus=cpus, include_dashboard=False, **common)
    return True


def build_local_model_files(cfg: ChatLearnConfig, eng: Engine) -> None:
    """Build local model files (e.g. the embedded tiny Llama) once, on the driver, not racing in every actor."""
    for name, mod in eng.modules.items():
        schema = getattr(mod, "args_schema", None)
        if schema is not None and "tiny_model" in schema.model_fields:
            from chatlearn.models.hf.common import ensure_model_files

            ensure_model_files(schema.model_validate(cfg.models[name].args_dict or {}))


@contextlib.contextmanager
def launch(cfg: ChatLearnConfig, eng: Engine, seed: int, data_checkpoint_path: str = "",
           with_train_data: bool = True) -> Iterator[tuple[RunHandle, dict[str, ModelGroup], Any]]:
    """Yield (RunHandle, model groups, StreamDataset actor) for a run; everything is torn down on exit."""
    rt = cfg.runtime
    producer_cfg = cfg.models[eng.plan.producer]
    key = (producer_cfg.args_dict or {}).get("prompt_key", "prompt")
    if with_train_data and not rt.data_path:
        raise DataError("runtime.data_path: no prompt file given")
    prompts = load_records(rt.data_path, key) if with_train_data else []
    eval_path = rt.get("eval_data_path")
    wants_eval = rt.eval_episode_interval or not with_train_data
    eval_prompts = load_records(eval_path, key) if eval_path and wants_eval else []
    if producer_cfg.batch_generation.min_prompt_length:
        logger.warning("models.%s.batch_generation.min_prompt_length=%d caps the first stage of Megatron's batch "
                       "generation; Hugging Face generate has no such stage, so the built-in policy ignores it",
                       eng.plan.producer, producer_cfg.batch_generation.min_prompt_length)
    if prompts and producer_cfg.batch_generation.ranking:
        from chatlearn.data.ranking import rank_prompts

        prompts = rank_prompts(prompts, rt.sample_per_episode, key)
    build_local_model_files(cfg, eng)

    namespace = f"chatlearn-{rt.exp_name}".replace(" ", "_")
    started_ray = init_ray(cfg, namespace)
    prefix = f"{uuid.uuid4().hex[:8]}-"
    groups: dict[str, ModelGroup] = {}
    stream = None
    try:
        t0 = time.perf_counter()
        for name, mod in eng.modules.items():
            groups[name] = create_model_group(name, mod, cfg.models[name], rt, seed, namespace, prefix)
        stream = ray.remote(StreamDataset).options(name=prefix + "stream-dataset", namespace=namespace,
                                                   num_cpus=0, max_restarts=0).remote(rt)
        infos = ray.get([a.setup.remote() for g in groups.values() for a in g.actors])
        logger.info("created %d actors for %d models in %.1fs", len(infos), len(groups), time.perf_counter() - t0)

        producer = groups[eng.plan.producer]
        sizes = [0]
        if prompts:
            prompts_ref = ray.put(prompts)
            sizes = ray.get([a.build_dataset.remote(prompts_ref) for a in producer.heads])
        if eval_prompts:
            eval_ref = ray.put(eval_prompts)
            ray.get([a.build_dataset.remote(eval_ref, True) for a in producer.heads])
        run = RunHandle(
            namespace=namespace,
            actors={n: [[prefix + f"{n}-r{r}-p{p}" for p in range(len(rep))] for r, rep in enumerate(g.replicas)]
                    for n, g in groups.items()},
            plan=eng.plan, dataset_size=sizes[0], eval_dataset_size=len(eval_prompts), run_dir=rt.run_dir,
            data_checkpoint_path=data_checkpoint_path, stream_actor=prefix + "stream-dataset",
            driver_pid=os.getpid(),
        )
        yield run, groups, stream
    finally:
        for g in groups.values():
            g.kill()
        if stream is not None:
            with contextlib.suppress(Exception):
                ray.kill(stream, no_restart=True)
        if started_ray:
            ray.shutdown()
