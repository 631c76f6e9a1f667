"""ChatLearn's module API: one model's user code, hosted by the framework inside Ray actors.

A user subclasses `BaseModule` (or `TorchModule`) and fills in `setup`, `forward_step(data, iteration)`,
`train_step(data_list, iteration)`, `eval_step` (or `eval_forward`), `save_checkpoint`, `load_checkpoint` and,
for the first model of an engine (the data producer), `build_dataset`. The framework owns scheduling: it
creates the actors from the model's `ModelConfig`, binds the configs, calls `setup` once, then streams batches
through the methods. `__init__` must stay cheap: the object is built on the driver and shipped to its actors.
"""

import os
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel

from chatlearn.config import ModelConfig, RuntimeConfig
from chatlearn.data.records import Records


class BaseModule:
    """One model of an engine (policy, reference, reward, ...), in ChatLearn's vocabulary.

    `args_schema`, when set, is a pydantic model that validates `models.<name>.args_dict` before any Ray or
    Prefect resource exists; `self.args` is then the parsed instance.
    """

    args_schema: ClassVar[type[BaseModel] | None] = None
    # True when the module works with a replica of several processes (it uses `process_group`); the
    # framework refuses multi-process layouts for modules that do not say so.
    multi_process: ClassVar[bool] = False
    # True when a built-in module runs pipeline-parallel replicas (pipeline_model_parallel_size > 1)
    supports_pipeline: ClassVar[bool] = False
    # What a trainer reads, which the engine checks ask of the models its trainer flow trains (so an engine of
    # one's own training a built-in trainer gets the checks the built-in engine of that trainer gets):
    # the advantage estimator a reward of its experience runs unless the reward's args_dict names one (None: it
    # trains on no advantages of a default kind);
    default_advantage_estimator: ClassVar[str | None] = None
    # it compares several responses to the same prompt (num_inference_per_prompt >= 2: GRPO, online DPO);
    trains_on_groups: ClassVar[bool] = False
    # it builds its samples inside each prompt group of a micro-batch (online DPO's pairs): no group may be cut;
    pairs_in_groups: ClassVar[bool] = False
    # it trains on multi-turn samples (runtime.task_type: agent), tool outputs masked out of the loss
    trains_multi_turn: ClassVar[bool] = False

    def __init__(self, name: str):
        self.name = name
        self._module_args: ModelConfig | None = None
        self._runtime_args: RuntimeConfig | None = None
        self.replica_id = 0
        self.seed = 0
        self.run_dir = "."
        self.args: Any = None
        # set by the framework when a replica has several processes (see `bind_process_group`)
        self.process_group: Any = None
        self.rank = 0
        self.replica_size = 1
        # the replica's layout and per-dimension groups (chatlearn.models.parallel), when it has several
        self.parallel: Any = None

    def run_notes(self, plan: Any) -> list[str]:
        """Lines the terminal shows once when a run starts, in the driver (e.g. where a trainer's inputs come
        from); ``plan`` is the run's episode plan (`chatlearn.runtime.plan.EpisodePlan`)."""
        return []

    def process_env(self, runtime_args: RuntimeConfig) -> dict[str, str]:
        """Environment variables the worker process hosting this model must start with (a library preloaded:
        they act before the interpreter does), asked by the driver before it starts the process; none by
        default."""
        return {}

    # -- wiring done by the framework, before setup() -------------------------------------------------------
    def bind(self, module_args: ModelConfig, runtime_args: RuntimeConfig, replica_id: int, seed: int) -> None:
        """Attach configs; called on the actor before `setup`."""
        self._module_args = module_args
        self._runtime_args = runtime_args
        self.replica_id = replica_id
        self.seed = seed
        self.run_dir = runtime_args.run_dir
        if self.args_schema is not None:
            self.args = self.args_schema.model_validate(module_args.args_dict or {})

    def bind_process_group(self, group: Any, rank: int, size: int) -> None:
        """The torch.distributed group of this model's replica and this process's rank in it; called before
        `setup` when the replica has several processes (what they do together is the module's to decide)."""
        self.process_group, self.rank, self.replica_size = group, rank, size

    @property
    def module_args(self) -> ModelConfig:
        assert self._module_args is not None, f"module {self.name} is not bound to a config yet"
        return self._module_args

    @property
    def runtime_args(self) -> RuntimeConfig:
        assert self._runtime_args is not None, f"module {self.name} is not bound to a config yet"
        return self._runtime_args

    @property
    def model_args(self) -> dict[str, Any]:
        """The backend's own hyper-parameters (`args_dict`, filled from `model_config_file`)."""
        return dict(self.module_args.args_dict or {})

    @property
    def trainable(self) -> bool:
        return bool(self.module_args.trainable)

    def checkpoint_dir(self, iteration: int) -> str:
        """Where this model's checkpoint for a trainer iteration lives: run_dir/checkpoints/<name>/iter_N."""
        return os.path.join(self.run_dir, "checkpoints", self.name, f"iter_{iteration:07d}")

    def prepare_files(self, module_args: ModelConfig) -> None:
        """Runs once on the driver before any actor of this model starts (e.g. build local model files),
        so the actors do not race to create the same files."""

    # -- user API -------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build models, tokenizers and optimizers. Runs once per actor."""

    def build_dataset(self, prompts: Sequence[Any], is_eval: bool = False) -> Any:
        """Turn raw prompt records into an indexable dataset (first model of the engine only). A run hands a
        `chatlearn.data.records.Records`: indexable already, and read lazily, so it is kept as it is."""
        return prompts if isinstance(prompts, Records) else list(prompts)

    def collate_fn(self, items: list[Any]) -> Any:
        """Combine dataset items into the batch handed to `forward_step`/`eval_step`."""
        return items

    def forward_step(self, data: Any, iteration: int) -> Any:
        """Inference on one batch; `data` is the merged output of the upstream models (or a prompt batch)."""
        raise NotImplementedError(f"{type(self).__name__}.forward_step")

    def train_step(self, data_list: list[Any], iteration: int) -> dict[str, float]:
        """One optimizer step over `data_list` (the micro-batches of one global batch)."""
        raise NotImplementedError(f"{type(self).__name__}.train_step")

    def eval_step(self, data: Any) -> Any:
        """Inference for evaluation; defaults to `forward_step`."""
        return self.forward_step(data, 0)

    def eval_forward(self, data: Any) -> Any:
        """Inference for evaluation under ChatLearn HEAD's name (its evaluator flows call it); defaults to
        `eval_step`."""
        return self.eval_step(data)

    def save_checkpoint(self, iteration: int) -> str | None:
        """Save the trainable state for `iteration`; returns where it went."""
        return None

    def load_checkpoint(self, iteration: int) -> None:
        """Restore the state saved by `save_checkpoint(iteration)`."""

    def before_episode(self) -> None:
        """Hook run on every rank of every model before each episode (before generation)."""

    def weights_synced(self) -> None:
        """Hook run on every rank of an inference model right after a parameter sync wrote its weights, by either
        route (a collective one or the object store), inside the sync stage: a copy of its own (the policy's
        rollout engine) takes them now. Overriding it, not ``set_weights``, keeps the collective route."""

    def after_episode(self) -> None:
        """Hook run on every rank of every model after each episode (after its checkpoint and eval, as in
        ChatLearn HEAD; v1.0.2 ran it before them)."""

    def peak_memory(self) -> float:
        """Peak memory of this process in MiB (GPU when the model is on one)."""
        return 0.0
