"""Bring a run's actors up and down, and build the context its episodes receive.

Shared by the train and eval flows. The flow process is the Ray driver; actors are created here (never in a
task: an actor created inside a task dies with it) and killed on the way out, failures included. What Ray
itself needs (joining or starting it, the runtime env, a local Ray's loopback-only mode) is
`chatlearn.runtime.cluster.launch`; the worker processes and their placement groups are
`chatlearn.runtime.cluster.model_group`.
"""

import contextlib
import gc
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator

import ray

from chatlearn.config import ChatLearnConfig
from chatlearn.config.user_code import user_code
from chatlearn.data.preflight import record_keys
from chatlearn.data.ranking import rank_prompts
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.calls.dispatch import FlowCalls
from chatlearn.runtime.calls.recovery import HeadLost, head_loss
from chatlearn.runtime.calls.stopping import on_stop
from chatlearn.runtime.calls.waiting import wait
from chatlearn.runtime.cluster import reaper
from chatlearn.runtime.cluster.head import HeadWatch, RayHeadGone, local_ray_pids
from chatlearn.runtime.cluster.launch import init_ray
from chatlearn.runtime.cluster.model_group import Workers, cluster_nodes, setup_models, start_workers
from chatlearn.runtime.cluster.placement import plan_placement
from chatlearn.runtime.cluster.stream_dataset import StreamDataset
from chatlearn.runtime.context import Actors, RunContext
from chatlearn.runtime.plan import ResolvedEngine
from chatlearn.runtime.prepared import PreparedRun
from chatlearn.runtime.rollout import rollout_for
from chatlearn.runtime.spec import RunSpec
from chatlearn.runtime.weights.sync import SyncRoute, check_specs, connect, plan_route
from chatlearn.runtime.weights.versions import PolicyWeights, WeightVersions
from chatlearn.utils.errors import find_error

__all__ = ["launch"]

logger = logging.getLogger("chatlearn")


@contextlib.contextmanager
def launch(prepared: PreparedRun, calls: FlowCalls, data_checkpoint_path: str = "") -> Iterator[RunContext]:
    """Yield the `RunContext` of a run whose actors are up; everything is torn down on exit. ``calls``: how the
    episodes run their flows' calls (the flows layer's).

    While it runs, the driver and every Ray worker find the user's code in the config's code folders
    (`chatlearn.config.user_code`)."""
    with user_code(prepared.cfg), _launch(prepared, calls, data_checkpoint_path) as ctx:
        yield ctx


@contextlib.contextmanager
def _launch(prepared: PreparedRun, calls: FlowCalls, data_checkpoint_path: str) -> Iterator[RunContext]:
    cfg, eng = prepared.cfg, prepared.engine
    rt = cfg.runtime
    spec = RunSpec.of(cfg, eng, data_checkpoint_path)
    producer_cfg = cfg.models[eng.plan.producer]
    key = record_keys(eng.modules[eng.plan.producer], producer_cfg.args_dict or {})
    # model files, records and prompt lengths were checked when the run was prepared, before Ray starts
    # lazy sequences (chatlearn.data.records): a large table travels to the actors as its file paths
    prompts, eval_prompts = prepared.data.prompts, prepared.data.eval_prompts
    if prompts and producer_cfg.batch_generation.ranking:
        prompts = rank_prompts(prompts, rt.sample_per_episode, key[0])
    build_local_model_files(cfg, eng.modules)

    names = list(eng.modules)
    started_ray = init_ray(cfg, spec.namespace, names)
    # a local Ray this run started ends with it, a SIGKILLed driver included, and the Ray head going away is
    # noticed within seconds (chatlearn.runtime.cluster.reaper, chatlearn.runtime.cluster.head)
    local = started_ray and not os.environ.get("RAY_ADDRESS")
    ray_reaper = reaper.Reaper(local_ray_pids()) if local and reaper.supported() else None
    watch = HeadWatch(local)
    stop_guard = contextlib.ExitStack()
    prefix = f"{uuid.uuid4().hex[:8]}-"
    workers: Workers | None = None
    stream = None

    def kill_all() -> None:  # on SIGTERM / Ctrl-C: every stage call blocked on an actor fails at once
        if workers is not None:
            workers.kill()
        if stream is not None:
            ray.kill(stream, no_restart=True)

    try:
        nodes, node_ids = cluster_nodes()
        plan = plan_placement(cfg, names, nodes)  # PlacementError before any actor starts
        for msg in plan.warnings:
            logger.warning("placement: %s", msg)
        t0 = time.perf_counter()
        stop_guard.enter_context(on_stop(kill_all))
        workers = start_workers(plan, node_ids, cfg, eng.modules, spec.namespace, prefix)
        stream = ray.remote(StreamDataset).options(name=prefix + "stream-dataset", namespace=spec.namespace,
                                                   num_cpus=0, max_restarts=0).remote(rt)
        infos = setup_models(workers, rt.concurrent_setup, rt.stage_timeout_s)
        write_placement(rt.run_dir, workers, node_ids, infos)
        logger.info("started %d worker processes for %d models in %.1fs", len(workers.actors), len(names),
                    time.perf_counter() - t0)

        producer = workers.groups[eng.plan.producer]
        sizes = [0]
        if prompts:
            prompts_ref = ray.put(prompts)
            sizes = wait([a.build_dataset.remote(prompts_ref) for a in producer.heads], "setup", rt.stage_timeout_s)
        if eval_prompts and eng.plan.evaluator is not None:  # the evaluator's first model answers the eval set
            eval_ref = ray.put(eval_prompts)
            answering = workers.groups[eng.plan.eval_producer]
            wait([a.build_dataset.remote(eval_ref, True) for a in answering.heads], "setup", rt.stage_timeout_s)
        actors = Actors({n: [[h.process for h in rep] for rep in g.replicas] for n, g in workers.groups.items()},
                        {workers.names[p]: a for p, a in workers.actors.items()})
        routes = sync_routes_of(cfg, eng, workers)
        yield RunContext(spec, actors, stream, rollout_for(spec, _policy_weights(spec, actors, routes)), calls,
                         sync_routes=routes, steps=dict(eng.steps), dataset_size=sizes[0],
                         eval_dataset_size=len(eval_prompts),
                         pad_token_id=int((infos.get(eng.plan.producer) or [{}])[0].get("pad_token_id", 0)),
                         placement=workers.plan.rows())
    except Exception as exc:  # with the Ray head gone, whatever broke on the way is the head's loss
        lost = head_loss(None)
        if lost is None:
            raise
        lost = find_error(exc, HeadLost) or lost  # the one a wait raised names the episode
        if not lost.local:  # a cluster's head: the run ends (one line; the flow run Crashed)
            raise RayHeadGone(lost.message) from exc
        if lost is exc:
            raise
        raise lost from exc
    finally:
        stop_guard.close()
        if watch.gone is not None:  # no GCS to ask: the actors are asked to exit by a call of their own
            watch.end_actors([*(workers.actors.values() if workers is not None else []), *filter(None, [stream])])
        else:
            if workers is not None:
                with contextlib.suppress(Exception):
                    ray.get([a.shutdown.remote() for a in workers.actors.values()], timeout=10)
                workers.kill()
            if stream is not None:
                with contextlib.suppress(Exception):
                    ray.kill(stream, no_restart=True)
        watch.close()
        if started_ray:
            # Garbage in reference cycles that still holds Ray objects (Prefect keeps task results and states in
            # memory) is collected now, while the core worker is up. A run was seen to end with status 1 and
            # Ray's "core worker has already been shutdown" from Prefect's API log thread just after shutdown; a
            # collection there freeing such objects is the likely path (not reproduced in isolation)
            gc.collect()
            ray.shutdown()
        if ray_reaper is not None:
            ray_reaper.close()


def _policy_weights(spec: RunSpec, actors: Actors, routes: list[SyncRoute]) -> PolicyWeights:
    """Where the policy's weights come from: published versions of the trainer's in pipelined episodes
    (``runtime.max_staleness`` > 0), else the sync stage."""
    if spec.runtime.max_staleness == 0:
        return PolicyWeights()
    route = next(r for r in routes if r.dst == spec.plan.producer)
    return WeightVersions(route, actors.process, spec.runtime.max_staleness, spec.runtime.stage_timeout_s)


def build_local_model_files(cfg: ChatLearnConfig, modules: dict[str, BaseModule]) -> None:
    """Build local model files (e.g. the embedded tiny Llama) once, on the driver, not racing in every actor."""
    for name, mod in modules.items():
        prepare = getattr(mod, "prepare_files", None)
        if prepare is not None:
            prepare(cfg.models[name])


def sync_routes_of(cfg: ChatLearnConfig, eng: ResolvedEngine, workers: Workers) -> list[SyncRoute]:
    """Plan each (trainer, inference) pair's weight route, check the two models' tensors agree (names, shapes,
    dtypes: a mismatch is an error now, not at the first sync) and join the sync groups (unless
    ``free_sync_collective_group``: then each sync joins and leaves its own)."""
    by_name = {workers.names[pid]: a for pid, a in workers.actors.items()}
    routes = []
    for src, dst in eng.plan.sync:
        sg, dg = workers.groups[src], workers.groups[dst]
        # a module's own get_weights/set_weights (`TorchModule.collective_sync`) puts the pair on the object store
        own = [type(eng.modules[m]).__name__ for m in (src, dst)
               if not getattr(type(eng.modules[m]), "collective_sync", False)]
        collective = not own
        route = plan_route(src, dst, [h.process for h in sg.replicas[0]],
                           [[h.process for h in rep] for rep in dg.replicas], collective, cfg.runtime)
        if collective:
            src_specs, dst_specs = wait([by_name[route.src_ranks[0]].sync_specs.remote(src, "src"),
                                         by_name[route.dst_ranks[0][0]].sync_specs.remote(dst, "dst")], "setup",
                                        cfg.runtime.stage_timeout_s)
            route.specs = check_specs(route, src_specs, dst_specs)
            if not route.free_group:
                connect(route, by_name.__getitem__)
        whose = f" ({' and '.join(own)} overrides get_weights/set_weights without sync_sources/sync_targets)"
        logger.info("param sync %s%s", route.describe(), whose if own else "")
        routes.append(route)
    return routes


def write_placement(run_dir: str, workers: Workers, node_ids: list[str], infos: dict[str, list[dict]]) -> None:
    """``run_dir/placement.json``: the plan, and where each rank really runs (Ray node id, GPU ids, pid)."""
    def record(info: dict) -> dict:
        return {"node_id": info["node"], "gpu_ids": [int(g) for g in info["gpu_ids"]], "pid": info["pid"],
                "setup_seconds": round(info["setup_seconds"], 3)}

    ranks = {}
    for name, reps in workers.plan.models.items():
        flat = iter(infos[name])  # setup infos come rank by rank, replica after replica
        ranks[name] = [[record(next(flat)) for _ in rep] for rep in reps]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "placement.json"), "w") as f:
        json.dump({"plan": workers.plan.to_json(), "nodes": node_ids, "ranks": ranks}, f, indent=1)
