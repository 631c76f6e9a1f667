"""One model's actors: `num_replica` replicas, each a list of processes, with Ray resources from its config.

The resource arithmetic follows ChatLearn: a GPU model spreads `num_gpu` over its replicas and asks
`gpu_per_process` GPUs per actor; a CPU-only model spreads `num_cpu` and asks `cpu_per_process` CPUs per
actor; a trainable model is always one replica. Actors are created once per run by the train flow (the Ray
driver), never inside a task: an actor created in a task dies with it.
"""

from dataclasses import dataclass, field
from typing import Any

import ray

from chatlearn.config import ModelConfig, RuntimeConfig
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.actor import ModelActor


def required_cpus(models: dict[str, ModelConfig]) -> float:
    """Logical CPUs the model actors ask Ray for, all models together."""
    return sum(m.layout.replicas * m.layout.processes * m.layout.cpus for m in models.values())


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


def create_model_group(name: str, module: BaseModule, cfg: ModelConfig, runtime: RuntimeConfig,
                       namespace: str | None = None, name_prefix: str = "") -> ModelGroup:
    """Start the actors of one model (their `setup` is the caller's to run, so all models set up at once)."""
    layout = cfg.layout
    remote_cls = ray.remote(ModelActor)
    group = ModelGroup(name=name, config=cfg)
    for r in range(layout.replicas):
        rep = []
        for p in range(layout.processes):
            opts: dict[str, Any] = dict(num_gpus=layout.gpus, num_cpus=layout.cpus, max_concurrency=1, max_restarts=0)
            if name_prefix:
                opts["name"] = f"{name_prefix}{name}-r{r}-p{p}"
            if namespace:
                opts["namespace"] = namespace
            rep.append(remote_cls.options(**opts).remote(module, cfg, runtime, r))
        group.replicas.append(rep)
    return group
