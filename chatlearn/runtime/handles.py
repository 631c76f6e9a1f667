"""What the episode tasks need to find the run's actors: names, not handles.

Prefect serializes flow parameters to JSON for its API, so the episode subflow gets a small, readable
`RunHandle` (namespace, actor names, dataset sizes, the plan) and each task looks its actors up by name.
`RefBox` carries ObjectRefs between tasks without RayTaskRunner resolving them (it `ray.get`s every bare
ObjectRef it finds in task parameters, which would drag rollouts through every task process).
"""

from typing import Any

import ray
from pydantic import BaseModel

from chatlearn.runtime.engine import EpisodePlan


class RunHandle(BaseModel):
    namespace: str
    actors: dict[str, list[list[str]]]
    plan: EpisodePlan
    dataset_size: int
    eval_dataset_size: int = 0
    run_dir: str
    data_checkpoint_path: str = ""
    stream_actor: str = ""
    driver_pid: int = 0

    def stream(self) -> Any:
        """The run's StreamDataset actor."""
        return ray.get_actor(self.stream_actor, namespace=self.namespace)

    def heads(self, model: str) -> list[Any]:
        """Process 0 of every replica of `model`."""
        return [ray.get_actor(rep[0], namespace=self.namespace) for rep in self.actors[model]]

    def all_actors(self, model: str) -> list[Any]:
        return [ray.get_actor(n, namespace=self.namespace) for rep in self.actors[model] for n in rep]


class RefBox:
    """An opaque holder of ObjectRefs (plus small metadata) that task runners pass through untouched."""

    def __init__(self, refs: list[Any], **meta: Any):
        self.refs = refs
        self.meta = meta

    def __len__(self) -> int:
        return len(self.refs)

    def __repr__(self) -> str:
        return f"RefBox({len(self.refs)} refs, {self.meta})"
