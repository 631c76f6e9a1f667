"""What every field of ChatLearn's config does here, and the check that keeps a knob from doing nothing.

Each seed field has a status:

* ``acts``: does what the reference says;
* ``refused``: a value other than the default would change results (LoRA, colocation, offloading) and is not
  implemented yet: an error naming the field;
* ``warned``: a value other than the default would only tune speed or diagnostics and is not implemented
  yet: one warning naming the field, and the run goes on;
* ``inert``: has no effect by design here (stated in the table).

The README's field table is :func:`markdown_table`; a test keeps the two equal. The refusal and the
warnings are part of an engine's checks (:mod:`chatlearn.config.engine_checks`), so ``chatlearn config``
still prints such a config.
"""

import sys
import warnings
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel

from chatlearn.config.errors import ConfigWarning
from chatlearn.config.model import BatchGenerationConfig, LoraConfig, ModelConfig
from chatlearn.config.root import ChatLearnConfig
from chatlearn.config.runtime import RuntimeConfig, RuntimeEnvConfig

__all__ = ["FIELDS", "Support", "markdown_table", "unsupported_values"]

Status = Literal["acts", "refused", "warned", "inert"]


class Support(NamedTuple):
    status: Status
    what: str


_NOT_YET = "not implemented yet"

FIELDS: dict[str, dict[str, Support]] = {
    "runtime_env": {
        "pip": Support("acts", "pip packages of the Ray runtime env of every actor and task"),
        "py_modules": Support("acts", "local modules shipped to every Ray worker (Ray runtime env)"),
        "working_dir": Support(
            "acts", "uploaded as the Ray runtime env's working_dir when joining a cluster (`RAY_ADDRESS`) "
            "and it is not the default (the current directory); a local run already runs there"
        ),
        "platform": Support("refused", "PAI-DLC multi-node bootstrap (`DLC`): " + _NOT_YET),
        "excludes": Support("acts", "files left out of the uploaded working_dir"),
    },
    "runtime": {
        "num_episode": Support("acts", "episodes to run"),
        "sample_per_episode": Support("acts", "prompts generated per episode"),
        "num_training_epoch": Support("acts", "passes over each episode's samples (later passes reshuffle)"),
        "generation_batch_size": Support("acts", "prompts per generation call (default of every model)"),
        "train_micro_batch_size": Support("acts", "samples per forward/backward"),
        "train_global_batch_size": Support("acts", "samples per optimizer step (gradient accumulation)"),
        "save_episode_interval": Support("acts", "model + data checkpoint every N episodes"),
        "log_interval": Support("acts", "metrics line every N episodes"),
        "data_path": Support("acts", "prompt file(s), JSONL or JSON"),
        "colocation": Support("refused", "models sharing devices: " + _NOT_YET),
        "eval_episode_interval": Support("acts", "eval every N episodes (0: never)"),
        "enable_resume_training": Support("acts", "resume from the newest good data checkpoint"),
        "data_checkpoint_path": Support("acts", "where data checkpoint records go (default run_dir/data_checkpoints)"),
        "max_data_ckpt_nums": Support("acts", "keep the newest N data checkpoints and their model checkpoints"),
        "load_data_checkpoint_iteration": Support("acts", "resume from this trainer iteration's record"),
        "stream_data_loader_type": Support("acts", "`fixed` or `dynamic` episode size"),
        "debug": Support("warned", "checking synced weights against the trainer's: " + _NOT_YET),
        "nsys": Support("warned", "NVTX ranges for nsys: " + _NOT_YET),
        "profiler_dir": Support("warned", "torch profiler traces: " + _NOT_YET),
        "coalesce_param": Support(
            "warned", "bucketed collective sync: " + _NOT_YET + " (sync goes through Ray's object store)"
        ),
        "coalesced_buffer_mb": Support("warned", "bucket size of collective sync: " + _NOT_YET),
        "concurrent_comm": Support("warned", "parallel collective sync groups: " + _NOT_YET),
        "param_sync_comm_type": Support("warned", "broadcast/p2p collective sync: " + _NOT_YET),
        "param_sync_max_workers": Support("warned", "threads of collective sync: " + _NOT_YET),
        "max_relay_episode": Support("acts", "relay window: 0 off, N the last N episodes, negative all"),
        "relay_episode_offset": Support("acts", "episodes before this one train without relay"),
        "consumed_samples": Support("acts", "where a fresh run starts in the prompt stream"),
        "concurrent_setup": Support("acts", "models are always set up concurrently here (both values)"),
        "bucket_size_mb_in_memory_manager": Support("warned", "offload buckets: " + _NOT_YET),
        "free_sync_collective_group": Support("warned", "rebuilding collective sync groups: " + _NOT_YET),
        "cpu_schedule_strategy": Support("warned", "PACK/SPREAD placement groups of CPU models: " + _NOT_YET),
        "exp_name": Support("acts", "run name; the run directory is output_dir/exp_name"),
        "output_dir": Support("acts", "parent of the run directory"),
        "seed": Support("acts", "seed of sampling, prompt shuffling and init"),
        "engine": Support("acts", "engine `chatlearn train` builds (`rlhf`)"),
        "data_shuffle": Support("acts", "shuffle each pass over the prompts, seeded"),
        "eval_data_path": Support("acts", "eval prompt file(s)"),
        "eval_post_process_fn": Support("acts", "hook turning eval results into metrics"),
        "relay_sample_fn": Support("acts", "hook building a relay episode's training samples"),
        "enable_eval_before_training": Support("acts", "eval once before the first episode"),
    },
    "models.X": {
        "num_device": Support("acts", "legacy alias of num_gpu"),
        "num_gpu": Support("acts", "GPUs of the model (all replicas)"),
        "num_cpu": Support("acts", "CPUs of a CPU-only model (all replicas)"),
        "gpu_per_process": Support("acts", "GPUs per actor process"),
        "cpu_per_process": Support("acts", "CPUs per actor process (also its torch threads)"),
        "num_replica": Support("acts", "derived; a CPU model's explicit value is honoured"),
        "trainable": Support("acts", "a trainer: one replica, runs train_step"),
        "tensor_model_parallel_size": Support("acts", "1 only: a replica of several processes is refused"),
        "pipeline_model_parallel_size": Support("acts", "1 only: a replica of several processes is refused"),
        "zero_size": Support("acts", "1 only: a replica of several processes is refused"),
        "model_config_file": Support("acts", "YAML read into args_dict"),
        "config_dir": Support("inert", "set by the loader: the main config's folder"),
        "model_type": Support("inert", "a free-form label, as in ChatLearn"),
        "generation_batch_size": Support("acts", "this model's batch size (<= 0: runtime's)"),
        "offload_optimizer_states": Support("refused", "optimizer offload between stages: " + _NOT_YET),
        "sync_frequency": Support("acts", "sync into this model every N episodes (0: never)"),
        "offload_weights": Support("refused", "weight offload between stages: " + _NOT_YET),
        "free_grad_buffers": Support("refused", "freeing gradient buffers between stages: " + _NOT_YET),
        "free_memory": Support("refused", "switch of the three above: " + _NOT_YET),
        "args_dict": Support("acts", "the module's own arguments (checked against its schema)"),
        "lora": Support("acts", "see models.X.lora.*"),
        "batch_generation": Support("acts", "see models.X.batch_generation.*"),
    },
    "models.X.lora": {
        "enable_lora": Support("refused", "LoRA adapters: " + _NOT_YET),
        "part_module_name": Support("inert", "only read with enable_lora"),
        "lora_dim": Support("inert", "only read with enable_lora"),
        "lora_dropout": Support("inert", "only read with enable_lora"),
        "lora_scaling": Support("inert", "only read with enable_lora"),
        "lora_layer": Support("inert", "only read with enable_lora"),
        "column_only_qkv": Support("inert", "only read with enable_lora"),
    },
    "models.X.batch_generation": {
        "ranking": Support("acts", "sort each episode's prompts longest first"),
        "min_prompt_length": Support("warned", "Megatron's first generation stage; Hugging Face generate has none"),
    },
}

_SET_BY_FREE_MEMORY = ("offload_weights", "free_grad_buffers", "offload_optimizer_states")

_CLASSES: dict[str, type[BaseModel]] = {
    "runtime_env": RuntimeEnvConfig,
    "runtime": RuntimeConfig,
    "models.X": ModelConfig,
    "models.X.lora": LoraConfig,
    "models.X.batch_generation": BatchGenerationConfig,
}


def _default(cls: type[BaseModel], name: str) -> Any:
    field = cls.model_fields[name]
    return field.default_factory() if field.default_factory is not None else field.default


def _given(section: BaseModel, cls: type[BaseModel], statuses: dict[str, Support], wanted: Status) -> list[str]:
    return [n for n, s in statuses.items() if s.status == wanted and getattr(section, n) != _default(cls, n)]


def _sections(cfg: ChatLearnConfig, models: Iterable[str]) -> list[tuple[str, str, BaseModel]]:
    out: list[tuple[str, str, BaseModel]] = [("runtime_env", "runtime_env", cfg.runtime_env),
                                              ("runtime", "runtime", cfg.runtime)]
    for name in models:
        m = cfg.models[name]
        out += [(f"models.{name}", "models.X", m), (f"models.{name}.lora", "models.X.lora", m.lora),
                (f"models.{name}.batch_generation", "models.X.batch_generation", m.batch_generation)]
    return out


def unsupported_values(cfg: ChatLearnConfig, models: Iterable[str]) -> list[str]:
    """Problems for values that would change results and are not implemented; warns (ConfigWarning) once
    per speed-only knob set away from its default. ``models`` are the models the engine runs."""
    problems: list[str] = []
    for prefix, kind, section in _sections(cfg, models):
        cls, statuses = _CLASSES[kind], FIELDS[kind]
        refused = _given(section, cls, statuses, "refused")
        if "free_memory" in refused:  # the switch sets the three others: name the switch only
            refused = [n for n in refused if n not in _SET_BY_FREE_MEMORY]
        for name in refused:
            problems.append(f"{prefix}.{name}: {getattr(section, name)!r} is not supported yet "
                            f"({statuses[name].what}); leave it at {_default(cls, name)!r}")
        for name in _given(section, cls, statuses, "warned"):
            warnings.warn(f"{prefix}.{name}={getattr(section, name)!r} has no effect here: {statuses[name].what}",
                          ConfigWarning, stacklevel=2)
    return problems


def markdown_table() -> str:
    """The README's table: every seed field, its status and what it does here."""
    rows = ["| field | here | what it does here |", "|---|---|---|"]
    for kind, statuses in FIELDS.items():
        for name, support in statuses.items():
            rows.append(f"| `{kind}.{name}` | {support.status} | {support.what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
