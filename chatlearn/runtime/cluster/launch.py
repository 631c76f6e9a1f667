"""Bring a run's actors up and down: Ray, the model actors, the StreamDataset, the prompt datasets.

Shared by the train and eval flows. The flow process is the Ray driver; actors are created here (never in a
task: an actor created inside a task dies with it) and killed on the way out, failures included.
"""

import contextlib
import gc
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import ray

from chatlearn.checkpoint.resume import models_to_checkpoint
from chatlearn.config import ChatLearnConfig
from chatlearn.config.engine_checks import group_size
from chatlearn.config.user_code import shipped_code, user_code
from chatlearn.data.preflight import record_keys
from chatlearn.data.ranking import rank_prompts
from chatlearn.envs.turns import TurnSpec
from chatlearn.models.base_module import BaseModule
from chatlearn.models.rule import RuleSpec
from chatlearn.runtime.calls.handles import RunHandle, own_actors
from chatlearn.runtime.calls.recovery import HeadLost, head_loss
from chatlearn.runtime.calls.stopping import keep_handlers, on_stop
from chatlearn.runtime.calls.waiting import wait
from chatlearn.runtime.cluster import ray_private, reaper
from chatlearn.runtime.cluster.head import HeadWatch, RayHeadGone, local_ray_pids
from chatlearn.runtime.cluster.model_group import ModelGroup, Workers, cluster_nodes, setup_models, start_workers
from chatlearn.runtime.cluster.placement import NodeSpec, plan_placement
from chatlearn.runtime.cluster.stream_dataset import StreamDataset
from chatlearn.runtime.plan import ResolvedEngine
from chatlearn.runtime.prepared import PreparedRun
from chatlearn.runtime.weights.sync import SyncRoute, check_specs, connect, plan_route
from chatlearn.utils.devices import fake_gpus
from chatlearn.utils.errors import find_error
from chatlearn.utils.imports import CODE_PATH_VAR, code_dirs, code_dirs_on_path

logger = logging.getLogger("chatlearn")

# Never uploaded with a working_dir: the local environment, history and run outputs.
ALWAYS_EXCLUDED = [".venv", ".git", "output"]
# Run in every Ray worker at its start: the user's code folders on its sys.path (chatlearn.utils.imports)
SETUP_HOOK = f"{code_dirs_on_path.__module__}.{code_dirs_on_path.__name__}"


def ray_runtime_env(cfg: ChatLearnConfig) -> dict[str, Any]:
    """`runtime_env` as Ray's runtime env, as ChatLearn builds it: pip, py_modules, excludes, the driver's
    PYTHONPATH, and the working_dir when it is not the current directory. (ChatLearn always uploads it; the
    current directory is left out here because relative paths such as ``./output`` would then resolve inside
    the uploaded copy on the workers, while the driver writes to the real one.)

    The user's code folders (the current directory, the config's folder, those of file-form hooks:
    `chatlearn.config.user_code`) go to every worker as ``CHATLEARN_CODE_PATH``, and a setup hook appends them
    to its ``sys.path`` (after the installed packages, so a folder of the project never shadows one). Joining a
    cluster (``RAY_ADDRESS``), whose other nodes may not share this file system, the hooks' own files are
    shipped as ``py_modules`` too."""
    env = cfg.runtime_env
    env_vars = {CODE_PATH_VAR: os.pathsep.join(code_dirs())}
    if os.environ.get("PYTHONPATH"):  # as ChatLearn: workers on every node see the driver's PYTHONPATH
        env_vars["PYTHONPATH"] = os.environ["PYTHONPATH"]
    out: dict[str, Any] = {"env_vars": env_vars, "worker_process_setup_hook": SETUP_HOOK}
    if env.pip:
        out["pip"] = list(env.pip)
    shipped = shipped_code(cfg) if os.environ.get("RAY_ADDRESS") else []
    py_modules = list(dict.fromkeys([*(env.py_modules or []), *shipped]))
    if py_modules:
        out["py_modules"] = py_modules
    if env.working_dir and os.path.abspath(env.working_dir) != os.getcwd():
        out["working_dir"] = env.working_dir
        out["excludes"] = list(env.excludes) + ALWAYS_EXCLUDED
    return out


def init_ray(cfg: ChatLearnConfig, namespace: str, names: list[str]) -> bool:
    """Join `RAY_ADDRESS` (or an already initialized Ray), else start a local Ray sized for the models.

    Returns whether this call started Ray (and so must shut it down). A local Ray gets at least as many
    logical CPUs as the plan's worker processes ask for, so CPU models schedule on a 2-core machine, and
    declares ``CHATLEARN_FAKE_GPUS`` GPUs when that is set (GPU placement tested without GPUs).
    """
    if ray.is_initialized():
        return False
    common: dict[str, Any] = dict(namespace=namespace, log_to_driver=False, configure_logging=False,
                                  runtime_env=ray_runtime_env(cfg))
    address = os.environ.get("RAY_ADDRESS")
    if address:
        if os.environ.get("CHATLEARN_NODE_IP_ADDRESS"):  # this machine's address in the cluster (DLC sets it)
            common.update(ray_private.node_ip_address(os.environ["CHATLEARN_NODE_IP_ADDRESS"]))
        with keep_handlers():
            ray.init(address=address, **common)
        _wait_for_nodes(int(os.environ.get("CHATLEARN_WAIT_FOR_NODES", "0") or 0))
        return True
    # Logical CPUs: what the workers ask for, plus room for the dispatch tasks' worker processes. Ray keeps
    # at most `num_cpus` idle workers; fewer would make it kill and re-spawn them (seconds of imports) often.
    gpus = fake_gpus() or None
    need = plan_placement(cfg, names, [NodeSpec(gpus or 10**6, None)]).cpus_required
    cpus = max(os.cpu_count() or 1, int(need + 0.999) + 4)
    # address="local": a new local Ray even when a `ray start` cluster (or its leftover address file) is on
    # this machine; joining one is what RAY_ADDRESS is for
    try:
        with loopback_only(), keep_handlers():
            ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False, **common)
    except BaseException:  # a stop (SIGTERM) or a failure halfway: what it started of the local Ray goes too,
        # the agents its raylet started included (they outlive their raylet by a minute: cluster/reaper.py)
        started = _local_ray_processes() if reaper.supported() else set()
        ray.shutdown()
        reaper.end(started)
        raise
    return True


def _local_ray_processes() -> set[reaper.Ident]:
    """What a local `ray.init` of this driver started so far, with everything below it (the raylet's agents and
    workers): the driver's descendants that run Ray's own programs, and their subtrees. (`ray.init` has no list
    of them until it has started them all.)"""
    ray_dir = os.path.dirname(ray.__file__) + os.sep

    def runs_ray(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return ray_dir.encode() in f.read()
        except OSError:
            return False

    return reaper.descendants(pid for pid, _ in reaper.descendants([os.getpid()]) if pid != os.getpid()
                              and runs_ray(pid))


def local_gpus() -> int:
    """The GPUs a local Ray started here would have: ``CHATLEARN_FAKE_GPUS``, else what Ray's own detection
    finds (the visible NVIDIA devices), 0 when it cannot tell."""
    if fake_gpus():
        return fake_gpus()
    try:
        count, visible = ray_private.local_accelerators("GPU")  # as Ray's ray.init detects them
        return min(count, len(visible)) if visible is not None else count
    except Exception:  # no driver library, an unknown platform: a machine without GPUs Ray can use
        return 0


def check_local_placement(cfg: ChatLearnConfig, names: list[str]) -> None:
    """For a run that starts its own local Ray (no ``RAY_ADDRESS``; the caller knows it is no DLC job), the plan
    against this machine before anything starts: a layout it cannot hold is a PlacementError now, one message,
    instead of after the Prefect server and Ray came up. CPUs never limit a local run (its Ray gets at least
    what the plan asks, `init_ray`). A run joining a cluster is checked against the live nodes in `launch`."""
    if os.environ.get("RAY_ADDRESS"):
        return
    plan_placement(cfg, names, [NodeSpec(local_gpus(), None)])


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Start a local Ray that listens on 127.0.0.1 only, with token authentication.

    Ray binds its gRPC servers (GCS, raylet, every worker and actor) and agents to all interfaces unless the
    node's address is the loopback one, and `ray.init(_node_ip_address="127.0.0.1")` is turned back into the
    machine's external address. Ray's macOS/Windows mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) is the one
    switch that makes a node use 127.0.0.1, and with it every server and agent binds loopback only
    (tests/test_local_run.py lists the sockets). The switch is read at import into `ray_constants`, so it is set
    there for this call and in the environment the Ray processes inherit, then put back: a later
    `ray.init(address=...)` joining a cluster in this process is not affected.

    Token authentication (`RAY_AUTH_MODE=token`, Ray generates `~/.ray/auth_token` once) is on unless the
    user chose a mode: other local users cannot reach the loopback ports without the token either.
    """
    if "RAY_AUTH_MODE" not in os.environ:  # as Ray's own default for a new local cluster, without its warning
        ray_private.enable_token_auth()  # sets the variable and refreshes the mode this process already cached
    with ray_private.ray_clusters_disabled():
        yield


def _wait_for_nodes(count: int, timeout_s: float = 300.0) -> None:
    """Wait until the cluster has ``count`` live nodes (a DLC job's WORLD_SIZE), so the placement sees them."""
    deadline = time.monotonic() + timeout_s
    while count > 1:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        if alive >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray cluster has {alive} of the job's {count} nodes after {timeout_s:.0f}s")
        time.sleep(1.0)


def build_local_model_files(cfg: ChatLearnConfig, modules: dict[str, BaseModule]) -> None:
    """Build local model files (e.g. the embedded tiny Llama) once, on the driver, not racing in every actor."""
    for name, mod in modules.items():
        prepare = getattr(mod, "prepare_files", None)
        if prepare is not None:
            prepare(cfg.models[name])


def _run_handle(cfg: ChatLearnConfig, eng: ResolvedEngine, workers: Workers, prefix: str,
                namespace: str, dataset_size: int, eval_size: int, data_checkpoint_path: str) -> RunHandle:
    rt, plan = cfg.runtime, eng.plan
    return RunHandle(
        namespace=namespace,
        actors={n: [[h.process for h in rep] for rep in g.replicas] for n, g in workers.groups.items()},
        placement=workers.plan.rows(),
        plan=plan, dataset_size=dataset_size, eval_dataset_size=eval_size, run_dir=rt.run_dir, exp_name=rt.exp_name,
        data_checkpoint_path=data_checkpoint_path, stream_actor=prefix + "stream-dataset",
        sample_per_episode=rt.sample_per_episode,
        generation_batch_size=cfg.models[plan.producer].generation_batch_size or rt.generation_batch_size,
        shuffle_seed=rt.shuffle_seed, group_size=group_size(cfg, plan.producer),
        sync_frequency={dst: cfg.models[dst].sync_frequency for _, dst in plan.sync},
        save_episode_interval=rt.save_episode_interval, num_episode=rt.num_episode,
        eval_episode_interval=rt.eval_episode_interval,
        checkpoint_models=models_to_checkpoint(cfg, plan.trainers, plan.sync) if plan.trainers else [],
        eval_post_process_fn=rt.eval_post_process_fn,
        rule_rewards=rule_rewards(cfg, eng),
        sync_routes=sync_routes_of(cfg, eng, workers),
        concurrent_comm=rt.concurrent_comm, param_sync_max_workers=rt.param_sync_max_workers,
        stage_timeout_s=rt.stage_timeout_s, steps=dict(eng.steps), max_staleness=rt.max_staleness,
        sampling_rounds=rt.max_sampling_rounds if rt.dynamic_sampling else 1,
        agent=_turn_spec(cfg, eng) if rt.task_type == "agent" else None,
    )


def _turn_spec(cfg: ChatLearnConfig, eng: ResolvedEngine) -> TurnSpec:
    """``runtime.agent`` with what an environment step needs of the policy (its answer length, its tokenizer)."""
    agent, name = cfg.runtime.agent, eng.plan.producer
    args = type(eng.modules[name]).args_schema.model_validate(cfg.models[name].args_dict or {})
    return TurnSpec(env=agent.env, env_args=agent.env_args, max_turns=agent.max_turns,
                    max_total_tokens=agent.max_total_tokens, max_new_tokens=args.max_new_tokens,
                    seed=cfg.runtime.seed, model_path=str(args.model_path),
                    num_cpus=agent.num_cpus_per_task, timeout_s=agent.timeout_s, retries=agent.retries)


def sync_routes_of(cfg: ChatLearnConfig, eng: ResolvedEngine, workers: Workers) -> list[SyncRoute]:
    """Plan each (trainer, inference) pair's weight route, check the two models' tensors agree (names, shapes,
    dtypes: a mismatch is an error now, not at the first sync) and join the sync groups (unless
    ``free_sync_collective_group``: then each sync joins and leaves its own)."""
    by_name = {workers.names[pid]: a for pid, a in workers.actors.items()}
    routes = []
    for src, dst in eng.plan.sync:
        sg, dg = workers.groups[src], workers.groups[dst]
        collective = all(getattr(type(eng.modules[m]), "collective_sync", False) for m in (src, dst))
        route = plan_route(src, dst, [h.process for h in sg.replicas[0]],
                           [[h.process for h in rep] for rep in dg.replicas], collective, cfg.runtime)
        if collective:
            src_specs, dst_specs = wait([by_name[route.src_ranks[0]].sync_specs.remote(src, "src"),
                                         by_name[route.dst_ranks[0][0]].sync_specs.remote(dst, "dst")], "setup",
                                        cfg.runtime.stage_timeout_s)
            route.specs = check_specs(route, src_specs, dst_specs)
            if not route.free_group:
                connect(route, by_name.__getitem__)
        routes.append(route)
    return routes


def rule_rewards(cfg: ChatLearnConfig, eng: ResolvedEngine) -> dict[str, RuleSpec]:
    """The rule rewards (``RuleReward`` modules with ``fan_out``, the default) the environment or evaluator flow
    calls: each batch they score is a Prefect task on Ray (``flows/rule_tasks.py``) before their model's call."""
    from chatlearn.models.hf.reward import RuleReward  # torch-heavy; launch runs once per run

    out = {}
    for name, module in eng.modules.items():
        if isinstance(module, RuleReward) and eng.plan.calls(name, "forward_step", "eval_step", "eval_forward",
                                                             "score_step"):
            args = RuleReward.args_schema.model_validate(cfg.models[name].args_dict or {})
            if args.fan_out:
                out[name] = RuleSpec.of(args)
    return out


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


@contextlib.contextmanager
def launch(prepared: PreparedRun,
           data_checkpoint_path: str = "") -> Iterator[tuple[RunHandle, dict[str, ModelGroup], Any]]:
    """Yield (RunHandle, model groups, StreamDataset actor) for a run; everything is torn down on exit.

    While it runs, the driver and every Ray worker find the user's code in the config's code folders
    (`chatlearn.config.user_code`)."""
    with user_code(prepared.cfg), _launch(prepared, data_checkpoint_path) as started:
        yield started


@contextlib.contextmanager
def _launch(prepared: PreparedRun, data_checkpoint_path: str) -> Iterator[tuple[RunHandle, dict[str, ModelGroup], Any]]:
    cfg, eng = prepared.cfg, prepared.engine
    rt = cfg.runtime
    producer_cfg = cfg.models[eng.plan.producer]
    key = record_keys(eng.modules[eng.plan.producer], producer_cfg.args_dict or {})
    # model files, records and prompt lengths were checked when the run was prepared, before Ray starts
    # lazy sequences (chatlearn.data.records): a large table travels to the actors as its file paths
    prompts, eval_prompts = prepared.data.prompts, prepared.data.eval_prompts
    if prompts and producer_cfg.batch_generation.ranking:
        prompts = rank_prompts(prompts, rt.sample_per_episode, key[0])
    build_local_model_files(cfg, eng.modules)

    namespace = f"chatlearn-{rt.exp_name}".replace(" ", "_")
    names = list(eng.modules)
    started_ray = init_ray(cfg, namespace, names)
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
        workers = start_workers(plan, node_ids, cfg, eng.modules, namespace, prefix)
        stream = ray.remote(StreamDataset).options(name=prefix + "stream-dataset", namespace=namespace,
                                                   num_cpus=0, max_restarts=0).remote(rt)
        stop_guard.enter_context(own_actors(namespace, {**{workers.names[p]: a for p, a in workers.actors.items()},
                                                        prefix + "stream-dataset": stream}))
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
        run = _run_handle(cfg, eng, workers, prefix, namespace, sizes[0], len(eval_prompts), data_checkpoint_path)
        run.pad_token_id = int((infos.get(eng.plan.producer) or [{}])[0].get("pad_token_id", 0))
        yield run, workers.groups, stream
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
