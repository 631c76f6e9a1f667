"""One model's actors: `num_replica` replicas, each a list of processes, with Ray resources from its config.

The resource arithmetic follows ChatLearn: a GPU model spreads `num_gpu` over its replicas and asks
`gpu_per_process` GPUs per actor; a CPU-only model spreads `num_cpu` and asks `cpu_per_process` CPUs per
actor; a trainable model is always one replica. Actors are created once per run by the train flow (the Ray
driver), never inside a task: an actor created in a task dies with it.
"""

from dataclasses import dataclass, field
from typing import Any

import ray

from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.actor import ModelActor
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig


def replica_layout(cfg: ModelConfig) -> tuple[int, int, dict[str, float]]:
    """(replicas, processes per replica, Ray resources per process) for a model config."""
    replicas = 1 if cfg.trainable else max(1, int(cfg.num_replica or 1))
    if cfg.num_gpu and cfg.num_gpu > 0:
        per_process = cfg.gpu_per_process or 1
        procs = max(1, cfg.num_gpu // replicas // per_process)
        return replicas, procs, {"num_gpus": float(per_process), "num_cpus": 0.0}
    per_process = cfg.cpu_per_process or 1
    procs = max(1, cfg.num_cpu // replicas // per_process)
    return replicas, procs, {"num_cpus": float(per_process), "num_gpus": 0.0}


def required_cpus(models: dict[str, ModelConfig]) -> float:
    """Logical CPUs the model actors ask Ray for, all models together."""
    total = 0.0
    for cfg in models.values():
        replicas, procs, res = replica_layout(cfg)
        total += replicas * procs * res["num_cpus"]
    return total


@dataclass
class ModelGroup:
    """The live actors of one model; `replicas[r][p]` is process p of replica r."""

    name: str
    config: ModelConfig
    replicas: list[list[Any]] = field(default_factory=list)

    @property
    def actors(self) -> list[Any]:
        return [a for rep in self.replicas for a in rep]

    @property
    def heads(self) -> list[Any]:
        """Process 0 of each replica: where batches are dispatched."""
        return [rep[0] for rep in self.replicas]

    @property
    def num_replica(self) -> int:
        return len(self.replicas)

    def kill(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing to clean
                pass
        self.replicas = []


def create_model_group(name: str, module: BaseModule, cfg: ModelConfig, runtime: RuntimeConfig, seed: int,
                       namespace: str | None = None, name_prefix: str = "") -> ModelGroup:
    """Start the actors of one model and run `setup` on each (returns when all are ready)."""
    replicas, procs, resources = replica_layout(cfg)
    remote_cls = ray.remote(ModelActor)
    group = ModelGroup(name=name, config=cfg)
    for r in range(replicas):
        rep = []
        for p in range(procs):
            opts: dict[str, Any] = dict(resources, max_concurrency=1, max_restarts=0)
            if name_prefix:
                opts["name"] = f"{name_prefix}{name}-r{r}-p{p}"
            if namespace:
                opts["namespace"] = namespace
            rep.append(remote_cls.options(**opts).remote(module, cfg, runtime, r, seed))
        group.replicas.append(rep)
    return group
