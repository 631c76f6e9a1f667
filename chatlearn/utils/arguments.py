"""ChatLearn configuration as pydantic v2 models.

The field names, types and defaults follow ChatLearn 1.0.2's ``chatlearn.utils.arguments``
(``RuntimeEnvConfig``, ``RuntimeConfig``, ``ModelConfig``, ``LoraConfig``, ``BatchGenerationConfig``), so
ChatLearn YAML files keep working. On top of ChatLearn this module:

* documents every field (``Field(description=...)``), so the JSON schema can drive a Prefect UI form;
* resolves the derived values ChatLearn computes at load time into the fields themselves (``num_gpu`` from
  the legacy ``num_device``, ``free_memory`` expansion, parallel sizes ``None -> 1``, ``num_replica``,
  per-model ``generation_batch_size``, ``train_global_batch_size``, ``output_dir/exp_name``), so a dumped
  config shows the effective values and validating it again is a no-op;
* reports *all* problems at once in one :class:`ConfigError` (pydantic type errors and cross-field checks
  together), each as ``"dotted.path: message"``.

Use ``ChatLearnConfig.model_validate(dict)`` (or :mod:`chatlearn.utils.config_loader`) to get a
:class:`ConfigError`; plain construction ``ChatLearnConfig(...)`` goes through pydantic only and reports the
same problems inside a pydantic ``ValidationError``.
"""

import json
import os
import re
import types
import typing
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "CPU_SCHEDULE_STRATEGIES",
    "EXTRA_VALIDATORS",
    "PARAM_SYNC_COMM_TYPES",
    "STREAM_DATA_LOADER_TYPES",
    "BatchGenerationConfig",
    "ChatLearnConfig",
    "ConfigError",
    "ConfigWarning",
    "LoraConfig",
    "ModelConfig",
    "RuntimeConfig",
    "RuntimeEnvConfig",
    "collect_problems",
]

STREAM_DATA_LOADER_TYPES = ("fixed", "dynamic")
PARAM_SYNC_COMM_TYPES = ("broadcast", "p2p")
CPU_SCHEDULE_STRATEGIES = ("PACK", "SPREAD")

# Keys a model's backend config file (``model_config_file``) may set that override ModelConfig fields.
PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "zero_size")

# Context flag: the sectional validation in ChatLearnConfig.model_validate already ran all checks.
_CHECKED = "_chatlearn_config_checked"


class ConfigError(ValueError):
    """Every problem found in a config, each as ``"dotted.path: message"``; ``str()`` lists one per line."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the problem list when pickled (Ray / Prefect ship exceptions between processes).
        return (type(self), (self.problems,))


class ConfigWarning(UserWarning):
    """Config accepted but something deserves attention (unknown key, deprecated alias, unset env var)."""


def _accepts_none(annotation: Any) -> bool:
    if annotation is None or annotation is Any or annotation is type(None):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts_none(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _accepts_none(typing.get_args(annotation)[0])
    return False


class _Section(BaseModel):
    """Shared behaviour: ``None`` for a field that cannot be ``None`` means "use the default".

    ChatLearn configs write ``key: ${ENV_VAR}``; when the variable is unset the value is ``None`` and
    ChatLearn keeps its default, so we do the same instead of failing on a type error.
    """

    model_config = ConfigDict(protected_namespaces=(), coerce_numbers_to_str=True)

    @model_validator(mode="before")
    @classmethod
    def _none_means_default(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            fields = cls.model_fields
            return {
                k: v
                for k, v in data.items()
                if not (v is None and k in fields and not _accepts_none(fields[k].annotation))
            }
        return data

    def get(self, key: str, default: Any = None) -> Any:
        """Value of a known field or of an extra (unknown) key kept from the YAML, else ``default``."""
        if key in type(self).model_fields:
            return getattr(self, key)
        extra = self.__pydantic_extra__ or {}
        return extra.get(key, default)


class RuntimeEnvConfig(_Section):
    """Runtime env config, you can refer https://docs.ray.io/en/latest/ray-core/handling-dependencies.html
    for more information. Unknown keys are kept and readable with ``get(key)``."""

    model_config = ConfigDict(extra="allow")

    pip: list[str] = Field(default_factory=list, description="pip install packages")
    py_modules: list[str] = Field(default_factory=list, description="python modules")
    working_dir: str = Field(
        default_factory=os.getcwd, description="working directory (default: the current directory)"
    )
    platform: str = Field(default="", description="platform, e.g., DLC")
    excludes: list[str] = Field(default_factory=list, description="excludes files from packaging")


class RuntimeConfig(_Section):
    """Training related configs. Unknown keys are kept and readable with ``get(key)``.

    After validation ``train_global_batch_size`` is never None (defaults to ``train_micro_batch_size``) and
    ``output_dir`` is the run directory ``output_dir/exp_name`` (see :attr:`run_dir`).
    """

    model_config = ConfigDict(extra="allow")

    num_episode: int = Field(
        default=5000,
        description="[required] number of episodes. One episode includes a inference and training loop.",
    )
    sample_per_episode: int = Field(default=1000, description="[required] number of samples per episode.")
    num_training_epoch: int = Field(
        default=1, description="[optional] number of training epoch per episode. default set to 1."
    )
    generation_batch_size: int = Field(default=2, description="[required] generation(inference) batch size.")
    train_micro_batch_size: int = Field(default=2, description="[required] training micro batch size.")
    train_global_batch_size: int | None = Field(
        default=None,
        description="[required] training global batch size. None: set to train_micro_batch_size; "
        "must be a multiple of train_micro_batch_size.",
    )
    save_episode_interval: int | None = Field(
        default=None, description="[required] save checkpoint per save_episode_interval episodes."
    )
    log_interval: int = Field(
        default=1, description="[optional] log time and memory per log_interval iterations."
    )
    data_path: str | list[str] | None = Field(
        default=None, description="[required] data_path for dataset (a path, or a list of paths)"
    )
    colocation: list[str] = Field(
        default_factory=list,
        description='[optional] colocate models into the same device: a list of groups, each "a,b,c" '
        "(a group may also be given as a list of model names)",
    )
    eval_episode_interval: int = Field(
        default=0, description="[optional] eval every N episode, if 0, will not eval"
    )
    enable_resume_training: bool = Field(
        default=True, description="[optional] enable resume training when data checkpoint is set"
    )
    data_checkpoint_path: str | None = Field(default=None, description="[optional] checkpoint for dataloader")
    max_data_ckpt_nums: int | None = Field(default=None, description="[optional] max data checkpoint nums")
    load_data_checkpoint_iteration: int | None = Field(
        default=None, description="[optional] load data checkpoint from iteration"
    )
    stream_data_loader_type: str = Field(
        default="fixed", description='[optional] stream_data_loader type, ["fixed", "dynamic"]'
    )
    debug: bool = Field(default=False, description="private")
    nsys: bool = Field(default=False, description="enable nsys nvtx")
    profiler_dir: str | None = Field(default=None, description="profiler dir")
    coalesce_param: bool = Field(default=True, description="coalesce parameters in model sync")
    coalesced_buffer_mb: int = Field(default=100, description="coalesce_buffer size in mb")
    concurrent_comm: bool = Field(default=True, description="concurrent parameter sync")
    param_sync_comm_type: str = Field(
        default="broadcast", description="parameter sync communication type, broadcast/p2p"
    )
    param_sync_max_workers: int | None = Field(default=None, description="parameter sync max workers")
    max_relay_episode: int = Field(
        default=0,
        description="max number of relay episodes, if max_relay_episode is set to -1, then relay all "
        "episodes if max_relay_episode is set to 0, then relay is disabled",
    )
    relay_episode_offset: int = Field(default=0, description="relay after n episodes")
    consumed_samples: int = Field(default=0, description="consumed samples")
    concurrent_setup: bool = Field(default=False, description="concurrent model setup")
    bucket_size_mb_in_memory_manager: int = Field(
        default=1024, description="bucket size in the memory manager to reduce peak memory"
    )
    free_sync_collective_group: bool = Field(
        default=False,
        description="free collective group after parameter synchronization and rebuild before next "
        "synchronization",
    )
    cpu_schedule_strategy: str = Field(
        default="SPREAD",
        description="[optional] cpu only model schedule policy, PACK or SPREAD PACK: All provided bundles "
        "are packed onto a single node on a best-effort basis. SPREAD: Each bundle is spread onto separate "
        "nodes on a best-effort basis.",
    )
    exp_name: str = Field(default="CHATLEARN", description="exp name for each run")
    output_dir: str = Field(
        default="./",
        description="output dir; after loading it is output_dir/exp_name (exp_name appended once)",
    )

    @field_validator("colocation", mode="before")
    @classmethod
    def _colocation_groups(cls, value: Any) -> Any:
        # Accept "a,b" (one group) and [[a, b], "c,d"] as well as ChatLearn's ["a,b", "c,d"].
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            groups = []
            for group in value:
                if isinstance(group, (list, tuple)):
                    group = ",".join(str(name) for name in group)
                if isinstance(group, str):
                    group = ",".join(n.strip() for n in group.split(",") if n.strip())
                    if not group:
                        continue
                groups.append(group)
            return groups
        return value

    @field_validator("stream_data_loader_type", "param_sync_comm_type", mode="after")
    @classmethod
    def _lower_choice(cls, value: str, info: ValidationInfo) -> str:
        # Case-insensitive like ChatLearn's validation, but normalized so later exact comparisons work.
        allowed = (
            STREAM_DATA_LOADER_TYPES
            if info.field_name == "stream_data_loader_type"
            else PARAM_SYNC_COMM_TYPES
        )
        return value.lower() if value.lower() in allowed else value

    @field_validator("cpu_schedule_strategy", mode="after")
    @classmethod
    def _upper_choice(cls, value: str) -> str:
        return value.upper() if value.upper() in CPU_SCHEDULE_STRATEGIES else value

    @model_validator(mode="after")
    def _resolve(self) -> "RuntimeConfig":
        if self.train_global_batch_size is None:
            self.train_global_batch_size = self.train_micro_batch_size
        self.output_dir = self.run_dir
        return self

    @property
    def run_dir(self) -> str:
        """``output_dir/exp_name``; unchanged when ``output_dir`` already ends with ``exp_name``."""
        out = self.output_dir or "./"
        if not self.exp_name or os.path.basename(os.path.normpath(out)) == self.exp_name:
            return out
        return os.path.join(out, self.exp_name)

    @property
    def colocation_groups(self) -> list[list[str]]:
        """``colocation`` split into lists of model names."""
        return [[n.strip() for n in g.split(",") if n.strip()] for g in self.colocation]


class BatchGenerationConfig(_Section):
    """Config for batch generation ranking and memory-efficiency. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    ranking: bool = Field(default=False, description="[optional] sort prompts by length each episode.")
    min_prompt_length: int = Field(
        default=0, description="[optional] min prompt length in the first stage of batch generation."
    )


class LoraConfig(_Section):
    """Config for lora. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    enable_lora: bool = Field(default=False, description="enable lora, default False.")
    part_module_name: str | None = Field(
        default=None,
        description='The "name_scope" parameter is used to specify a particular module to be converted to '
        "its LoRA. By default, it is set to None, which means there is no restriction on the module and any "
        'module can be converted using the "lora_layer" parameter. However, if "name_scope" is set to a '
        'specific value (e.g., "encoder"), only the modules whose name_scope contains the value "encoder" '
        "will be converted to LoRA.",
    )
    lora_dim: int = Field(
        default=8, description="The rank value of the LoRA, which is the r dimension of the A/B matrix."
    )
    lora_dropout: float = Field(
        default=0.0,
        description="The LoRA dropout ratio refers to whether dropout computation is inserted in the "
        "forward pass of the LoRA layer. By default, the dropout ratio is set to 0.0.",
    )
    lora_scaling: float = Field(
        default=1.0,
        description="When adding the values of the LoRA A and B matrices to the original weight matrix, the "
        'scaling value is set as "W = W + A * B * lora_scaling". '
        "By default, the scaling value is set to 1.0.",
    )
    lora_layer: str = Field(
        default="ColumnParallelLinear,Embedding,LinearLayer,RowParallelLinear,VocabParallelEmbedding",
        description="The layer class names involved in LoRA training in the model, separated by commas.",
    )
    column_only_qkv: bool = Field(
        default=False,
        description="LoRA training is enabled only in the ColumnParallelLinear layer of the MHA QKV module.",
    )


class ModelConfig(_Section):
    """Config for model.

    Unknown keys are kept (ChatLearn only warns "unknown argument"); loading warns about each one.
    Derived values are resolved on validation: ``num_gpu`` from the legacy ``num_device`` (``num_gpu`` wins
    when both are given, afterwards both hold the same value); ``free_memory`` switches on
    ``offload_weights`` and, for trainable models, ``free_grad_buffers`` and ``offload_optimizer_states``;
    parallel sizes ``None -> 1``; ``gpu_per_process``/``cpu_per_process`` ``None -> 1`` for GPU/CPU models;
    ``num_replica`` (see its description). ``generation_batch_size <= 0`` is resolved by ChatLearnConfig.
    """

    model_config = ConfigDict(extra="allow")

    num_device: int = Field(
        default=0, description="[legacy] number of GPU used for one model, default 0. Alias of num_gpu."
    )
    num_gpu: int = Field(
        default=0,
        description="[required] number of GPU used for one model, default 0, same as num_device "
        "(num_gpu wins if both are given)",
    )
    num_cpu: int = Field(
        default=0,
        description="[required] number of CPU used for one model (CPU-only model), default 0",
    )
    gpu_per_process: int | None = Field(
        default=None,
        description="[optional] gpu per process, e.g., for PyTorch DDP, Megatron, DeepSpeed, gpu_per_process "
        "is set to 1 (None: 1 for a GPU model)",
    )
    cpu_per_process: int | None = Field(
        default=None, description="[optional] cpu per process (None: 1 for a CPU model)"
    )
    num_replica: int = Field(
        default=1,
        description="[optional] number of module replica, for gpu model, num_replica = num_gpu // (TP * PP) "
        "(num_gpu // zero_size if zero_size > 1), for cpu model, num_replica = num_cpu // cpu_per_process "
        "unless given explicitly. Derived; trainable models always run as one replica (num_replica = 1, "
        "their GPUs form data-parallel ranks).",
    )
    trainable: bool = Field(default=False, description="[required] whether model is trainable")
    tensor_model_parallel_size: int | None = Field(
        default=None, description="[optional] tensor model parallel size (None: 1)"
    )
    pipeline_model_parallel_size: int | None = Field(
        default=None, description="[optional] pipeline model parallel size (None: 1)"
    )
    zero_size: int | None = Field(default=None, description="[optional] zero size (None: 1)")
    model_config_file: str = Field(
        default="",
        description="[optional] config file for model; parsed (with includes and ${ENV} values) into "
        "args_dict, and its tensor/pipeline parallel sizes and zero_size override these fields",
    )
    config_dir: str = Field(default="", description="directory of the main config file")
    model_type: str = Field(default="", description="[optional] model type, e.g., Torch/Tensorflow, etc")
    generation_batch_size: int | None = Field(
        default=-1,
        description="[optional] generation batch size, will overwrite generation batch size in "
        "RuntimeConfig (<= 0 or None: use runtime.generation_batch_size)",
    )
    offload_optimizer_states: bool = Field(default=False, description="offload optimizer states")
    sync_frequency: int = Field(default=1, description="parameter sync frequency")
    offload_weights: bool = Field(default=False, description="offload weights")
    free_grad_buffers: bool = Field(default=False, description="free grad buffers")
    free_memory: bool = Field(
        default=False,
        description="overall switch for offload optimizer states/weights and free grad buffers",
    )
    args_dict: dict[str, Any] = Field(
        default_factory=dict, description="[optional] placeholder for other args (backend hyper-parameters)"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="lora config")
    batch_generation: BatchGenerationConfig = Field(
        default_factory=BatchGenerationConfig, description="batch generation config"
    )

    @model_validator(mode="after")
    def _resolve(self) -> "ModelConfig":
        given = set(self.model_fields_set)
        if "num_gpu" not in given and "num_device" in given:
            self.num_gpu = self.num_device
        self.num_device = self.num_gpu
        if self.free_memory:
            self.offload_weights = True
            if self.trainable:
                self.free_grad_buffers = True
                self.offload_optimizer_states = True
        for key in PARALLEL_KEYS:
            if getattr(self, key) is None:
                setattr(self, key, 1)
        if self.gpu_per_process is None and self.num_gpu > 0:
            self.gpu_per_process = 1
        if self.cpu_per_process is None and self.num_cpu > 0:
            self.cpu_per_process = 1
        self.num_replica = self._derived_num_replica(explicit="num_replica" in given)
        return self

    def _derived_num_replica(self, explicit: bool) -> int:
        tp = self.tensor_model_parallel_size or 1
        pp = self.pipeline_model_parallel_size or 1
        zero = self.zero_size or 1
        if self.trainable:
            return 1
        if self.num_gpu > 0:
            if zero > 1:
                return self.num_gpu // zero
            if tp * pp > 0:
                return self.num_gpu // (tp * pp)
            return self.num_replica
        if self.num_cpu > 0 and not explicit and self.cpu_per_process and self.cpu_per_process > 0:
            return self.num_cpu // self.cpu_per_process
        return self.num_replica

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks inside one replica: GPUs per replica // (TP * PP); 1 for CPU models."""
        if self.num_gpu <= 0:
            return 1
        per_replica = self.num_gpu // max(self.num_replica, 1)
        tp_pp = (self.tensor_model_parallel_size or 1) * (self.pipeline_model_parallel_size or 1)
        return max(per_replica // max(tp_pp, 1), 1)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|tuple\[.*\]|[a-z-]+\[.*\])$")


def _owner_name(model_cls: type[BaseModel], loc: Sequence[Any]) -> str:
    cls: Any = model_cls
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field is not None else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:
            return cls.__name__
    return cls.__name__


def _problems_from_validation_error(
    err: ValidationError, prefix: str, model_cls: type[BaseModel]
) -> list[str]:
    """Turn pydantic's errors into ``"dotted.path: message"`` lines."""
    by_path: dict[str, list[str]] = {}
    for item in err.errors(include_url=False):
        loc = list(item["loc"])
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            owner = _owner_name(model_cls, loc[:-1])
            msg = f"unknown key, not defined in {owner}"
        else:
            # Union members add their type to the location ("data_path.str"): drop it, merge messages.
            loc = [p for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p))]
            for lead in ("Value error, ", "Assertion failed, "):
                if msg.startswith(lead):
                    msg = msg[len(lead) :]
        path = ".".join([prefix] * bool(prefix) + [str(p) for p in loc]) or "config"
        messages = by_path.setdefault(path, [])
        if msg not in messages:
            messages.append(msg)
    return [f"{path}: {'; or: '.join(messages)}" for path, messages in by_path.items()]


def _resolve_generation_batch_size(runtime: RuntimeConfig, models: Mapping[str, ModelConfig]) -> None:
    for model in models.values():
        if model.generation_batch_size is None or model.generation_batch_size <= 0:
            model.generation_batch_size = runtime.generation_batch_size


def _warn_unknown_model_keys(models: Mapping[str, ModelConfig]) -> None:
    for name, model in models.items():
        for key in model.model_extra or {}:
            warnings.warn(
                f"models.{name}.{key}: unknown argument, kept but not used by ChatLearn",
                ConfigWarning,
                stacklevel=4,
            )


def _check_runtime(rt: RuntimeConfig, dropped: Collection[str] = ()) -> list[str]:
    """Range and choice checks of ``runtime``; a check is skipped when a field it reads failed to parse."""
    problems: list[str] = []

    def need(ok: bool, field: str, msg: str, deps: Sequence[str] = ()) -> None:
        if not ok and field not in dropped and not any(d in dropped for d in deps):
            problems.append(f"runtime.{field}: {msg}, got {getattr(rt, field)!r}")

    need(rt.num_episode >= 0, "num_episode", "must be >= 0")
    need(rt.sample_per_episode > 0, "sample_per_episode", "must be > 0")
    need(rt.num_training_epoch >= 1, "num_training_epoch", "must be >= 1")
    need(rt.generation_batch_size > 0, "generation_batch_size", "must be > 0")
    need(rt.train_micro_batch_size > 0, "train_micro_batch_size", "must be > 0")
    gbs, micro = rt.train_global_batch_size, rt.train_micro_batch_size
    if gbs is not None:
        if gbs <= 0:
            need(False, "train_global_batch_size", "must be > 0", ["train_micro_batch_size"])
        elif micro > 0 and gbs % micro != 0:
            need(
                False,
                "train_global_batch_size",
                f"must be a multiple of train_micro_batch_size ({micro})",
                ["train_micro_batch_size"],
            )
    if rt.save_episode_interval is not None:
        need(rt.save_episode_interval >= 0, "save_episode_interval", "must be >= 0 (or null: never save)")
    need(rt.log_interval >= 1, "log_interval", "must be >= 1")
    need(rt.eval_episode_interval >= 0, "eval_episode_interval", "must be >= 0 (0: never eval)")
    need(rt.max_relay_episode >= -1, "max_relay_episode", "must be -1 (all), 0 (off) or a positive number")
    need(rt.relay_episode_offset >= 0, "relay_episode_offset", "must be >= 0")
    need(rt.consumed_samples >= 0, "consumed_samples", "must be >= 0")
    need(rt.coalesced_buffer_mb > 0, "coalesced_buffer_mb", "must be > 0")
    need(rt.bucket_size_mb_in_memory_manager > 0, "bucket_size_mb_in_memory_manager", "must be > 0")
    if rt.max_data_ckpt_nums is not None:
        need(rt.max_data_ckpt_nums >= 1, "max_data_ckpt_nums", "must be >= 1 (or null: keep all)")
    if rt.param_sync_max_workers is not None:
        need(
            rt.param_sync_max_workers == -1 or rt.param_sync_max_workers >= 1,
            "param_sync_max_workers",
            "must be -1 (all), >= 1, or null (automatic)",
        )
    need(
        rt.stream_data_loader_type.lower() in STREAM_DATA_LOADER_TYPES,
        "stream_data_loader_type",
        "must be one of 'fixed', 'dynamic' (case-insensitive)",
    )
    need(
        rt.param_sync_comm_type.lower() in PARAM_SYNC_COMM_TYPES,
        "param_sync_comm_type",
        "must be one of 'broadcast', 'p2p' (case-insensitive)",
    )
    need(
        rt.cpu_schedule_strategy.upper() in CPU_SCHEDULE_STRATEGIES,
        "cpu_schedule_strategy",
        "must be one of 'PACK', 'SPREAD' (case-insensitive)",
    )
    return problems


def _check_colocation(rt: RuntimeConfig, model_names: Sequence[str]) -> list[str]:
    """Each colocation group names known models, and no model is in two groups."""
    problems: list[str] = []
    group_of: dict[str, str] = {}
    reported: set[str] = set()
    for group, names in zip(rt.colocation, rt.colocation_groups, strict=True):
        for i, name in enumerate(names):
            if name not in model_names:
                problems.append(
                    f"runtime.colocation: group '{group}' names unknown model '{name}' "
                    f"(models: {', '.join(model_names) or 'none'})"
                )
            elif name in names[:i]:
                problems.append(f"runtime.colocation: model '{name}' is listed twice in group '{group}'")
            elif name in group_of and name not in reported:
                reported.add(name)
                problems.append(
                    f"runtime.colocation: model '{name}' is in more than one colocation group "
                    f"('{group_of[name]}' and '{group}')"
                )
            group_of.setdefault(name, group)
    return problems


_GPU_KEYS = ("num_gpu", "num_device")
_SHAPE_KEYS = (
    "num_gpu",
    "num_device",
    "num_cpu",
    "gpu_per_process",
    "cpu_per_process",
    "num_replica",
    "trainable",
    *PARALLEL_KEYS,
)


def _check_model(
    name: str,
    m: ModelConfig,
    rt: RuntimeConfig | None,
    dropped: Collection[str] = (),
    rt_dropped: Collection[str] = (),
) -> list[str]:
    """Resource, parallelism and batch checks of one model (skipping those reading unparsed fields)."""
    pre = f"models.{name}"
    problems: list[str] = []

    def parsed(*keys: str) -> bool:
        return not any(k in dropped for k in keys)

    if m.num_gpu < 0 and parsed(*_GPU_KEYS):
        problems.append(f"{pre}.num_gpu: must be >= 0, got {m.num_gpu}")
    if m.num_cpu < 0 and parsed("num_cpu"):
        problems.append(f"{pre}.num_cpu: must be >= 0, got {m.num_cpu}")
    if m.num_gpu <= 0 and m.num_cpu <= 0 and parsed(*_GPU_KEYS, "num_cpu"):
        hint = ""
        if m.model_extra:
            hint = f" (unknown keys given: {', '.join(m.model_extra)})"
        problems.append(
            f"{pre}: needs GPUs or CPUs: set num_gpu > 0 (GPU model) or num_cpu > 0 (CPU-only model), "
            f"got num_gpu={m.num_gpu}, num_cpu={m.num_cpu}{hint}"
        )
    tp, pp, zero = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.zero_size
    sizes_ok = parsed(*PARALLEL_KEYS)
    for key in PARALLEL_KEYS:
        value = getattr(m, key)
        if value is not None and value < 1 and parsed(key):
            sizes_ok = False
            problems.append(f"{pre}.{key}: must be >= 1, got {value}")
    if m.num_gpu == 0 and m.num_cpu > 0 and m.gpu_per_process and parsed(*_GPU_KEYS):
        problems.append(f"{pre}.gpu_per_process: {m.gpu_per_process} exceeds num_gpu (0)")
    if m.num_gpu > 0 and parsed(*_GPU_KEYS):
        gpp = m.gpu_per_process
        if gpp is not None and gpp < 1 and parsed("gpu_per_process"):
            problems.append(f"{pre}.gpu_per_process: must be >= 1, got {gpp}")
        elif gpp is not None and gpp > m.num_gpu and parsed("gpu_per_process"):
            problems.append(f"{pre}.gpu_per_process: {gpp} exceeds num_gpu ({m.num_gpu})")
        if sizes_ok and tp and pp and zero:
            if zero > 1 and (tp > 1 or pp > 1):
                problems.append(
                    f"{pre}.zero_size: zero_size > 1 cannot be combined with tensor/pipeline parallelism "
                    f"(tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp})"
                )
            elif zero > 1 and m.num_gpu % zero != 0:
                problems.append(f"{pre}.zero_size: {zero} does not divide num_gpu ({m.num_gpu})")
            elif zero == 1 and m.num_gpu % (tp * pp) != 0:
                problems.append(
                    f"{pre}.num_gpu: {m.num_gpu} is not divisible by tensor_model_parallel_size * "
                    f"pipeline_model_parallel_size = {tp}*{pp} = {tp * pp}"
                )
    if m.num_cpu > 0 and parsed("num_cpu"):
        cpp = m.cpu_per_process
        if cpp is not None and cpp < 1 and parsed("cpu_per_process"):
            problems.append(f"{pre}.cpu_per_process: must be >= 1, got {cpp}")
        elif cpp is not None and cpp > m.num_cpu and parsed("cpu_per_process"):
            problems.append(f"{pre}.cpu_per_process: {cpp} exceeds num_cpu ({m.num_cpu})")
        elif m.num_gpu <= 0 and m.num_replica < 1 and parsed(*_SHAPE_KEYS):
            problems.append(f"{pre}.num_replica: must be >= 1, got {m.num_replica}")
    if m.sync_frequency < 0 and parsed("sync_frequency"):
        problems.append(f"{pre}.sync_frequency: must be >= 0 (0: never sync), got {m.sync_frequency}")
    if parsed("lora"):
        if m.lora.lora_dim < 1:
            problems.append(f"{pre}.lora.lora_dim: must be >= 1, got {m.lora.lora_dim}")
        if not 0.0 <= m.lora.lora_dropout < 1.0:
            problems.append(f"{pre}.lora.lora_dropout: must be in [0, 1), got {m.lora.lora_dropout}")
    if parsed("batch_generation") and m.batch_generation.min_prompt_length < 0:
        problems.append(
            f"{pre}.batch_generation.min_prompt_length: must be >= 0, "
            f"got {m.batch_generation.min_prompt_length}"
        )
    gbs = m.generation_batch_size
    if (
        rt is not None
        and not m.trainable
        and gbs is not None
        and gbs > 0
        and rt.sample_per_episode > 0
        and m.num_replica * gbs > rt.sample_per_episode
        and parsed(*_SHAPE_KEYS, "generation_batch_size")
        and not any(k in rt_dropped for k in ("sample_per_episode", "generation_batch_size"))
    ):
        problems.append(
            f"{pre}.generation_batch_size: num_replica ({m.num_replica}) * generation_batch_size ({gbs}) "
            f"= {m.num_replica * gbs} exceeds runtime.sample_per_episode ({rt.sample_per_episode})"
        )
    return problems


def _check_sections(
    runtime: RuntimeConfig | None,
    models: Mapping[str, ModelConfig],
    model_names: Sequence[str],
    rt_dropped: Collection[str] = (),
    models_dropped: Mapping[str, Collection[str]] | None = None,
) -> list[str]:
    problems: list[str] = []
    models_dropped = models_dropped or {}
    if runtime is not None:
        problems += _check_runtime(runtime, rt_dropped)
        if "colocation" not in rt_dropped:
            problems += _check_colocation(runtime, model_names)
    for name, model in models.items():
        problems += _check_model(name, model, runtime, models_dropped.get(name, ()), rt_dropped)
    return problems


def _validate_partially(
    model_cls: type[BaseModel], raw: Mapping[str, Any], prefix: str, **kwargs: Any
) -> tuple[Any, list[str], set[str]]:
    """Validate a section; on errors, also validate it without the bad keys (their defaults used).

    Returns (object or None, problems, keys that failed) so cross-field checks can still run on the
    fields that did parse, skipping the checks that read a failed field.
    """
    try:
        return model_cls.model_validate(raw, **kwargs), [], set()
    except ValidationError as exc:
        problems = _problems_from_validation_error(exc, prefix, model_cls)
        error = exc
    dropped: set[str] = set()
    data = dict(raw)
    for _ in range(3):
        bad = {e["loc"][0] for e in error.errors() if e["loc"] and isinstance(e["loc"][0], str)}
        if not bad or bad <= dropped:
            break
        dropped |= bad
        data = {k: v for k, v in data.items() if k not in dropped}
        try:
            return model_cls.model_validate(data, **kwargs), problems, dropped
        except ValidationError as exc:
            error = exc
    return None, problems, dropped


def _run_extra_validators(cfg: "ChatLearnConfig") -> list[str]:
    problems: list[str] = []
    for fn in list(EXTRA_VALIDATORS):
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            problems += list(fn(cfg) or [])
        except ConfigError as exc:
            problems += exc.problems
        except Exception as exc:  # a broken validator must not hide the other problems
            problems.append(f"config: validator {name} failed: {type(exc).__name__}: {exc}")
    return problems


def collect_problems(cfg: "ChatLearnConfig") -> list[str]:
    """All cross-field problems of a parsed config (built-in checks, then ``EXTRA_VALIDATORS``)."""
    problems = _check_sections(cfg.runtime, cfg.models, list(cfg.models))
    problems += _run_extra_validators(cfg)
    return list(dict.fromkeys(problems))


def _normalize_top_level(data: Mapping[str, Any], problems: list[str] | None) -> dict[str, Any]:
    """Apply the deprecated ``rlhf`` alias, drop ``runtime.save_interval`` (an error) and unknown keys."""
    data = dict(data)
    if "rlhf" in data:
        warnings.warn("rlhf: deprecated top-level key, use 'runtime' instead", ConfigWarning, stacklevel=5)
        legacy = data.pop("rlhf")
        current = data.get("runtime")
        if isinstance(legacy, Mapping) and isinstance(current, Mapping):
            data["runtime"] = {**legacy, **current}
        elif current is None:
            data["runtime"] = legacy
    runtime = data.get("runtime")
    if isinstance(runtime, Mapping) and "save_interval" in runtime:
        message = "runtime.save_interval: no longer supported, use save_episode_interval instead"
        if problems is None:
            raise ValueError(message)
        problems.append(message)
        data["runtime"] = {k: v for k, v in runtime.items() if k != "save_interval"}
    for key in list(data):
        if key not in ChatLearnConfig.model_fields:
            warnings.warn(
                f"{key}: unknown top-level key ignored (known: runtime_env, runtime, models)",
                ConfigWarning,
                stacklevel=5,
            )
            del data[key]
    return data


class ChatLearnConfig(BaseModel):
    """A whole ChatLearn config: ``runtime_env``, ``runtime`` and the ``models`` (name -> ModelConfig).

    ``ChatLearnConfig.model_validate(dict)`` validates each section separately and raises one
    :class:`ConfigError` listing every problem (type errors and cross-field checks). Validating an already
    resolved dump again gives an equal config.
    """

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    runtime_env: RuntimeEnvConfig = Field(
        default_factory=RuntimeEnvConfig, description="Ray runtime env (pip, py_modules, working_dir, ...)"
    )
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig,
        description="training related configs (episodes, batch sizes, colocation, checkpoints, ...)",
    )
    models: dict[str, ModelConfig] = Field(
        default_factory=dict, description="the models of the job, by name, in the order they were given"
    )

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return _normalize_top_level(data, None)
        return data

    @model_validator(mode="after")
    def _resolve_and_check(self, info: ValidationInfo) -> "ChatLearnConfig":
        _resolve_generation_batch_size(self.runtime, self.models)
        if not (info.context or {}).get(_CHECKED):
            _warn_unknown_model_keys(self.models)
            problems = collect_problems(self)
            if problems:
                raise ValueError("\n".join(problems))
        return self

    @classmethod
    def model_validate(
        cls,
        obj: Any,
        *,
        strict: bool | None = None,
        from_attributes: bool | None = None,
        context: Any | None = None,
        **kwargs: Any,
    ) -> "ChatLearnConfig":
        """Validate a dict section by section and raise one :class:`ConfigError` with every problem."""
        if not isinstance(obj, Mapping):
            return super().model_validate(
                obj, strict=strict, from_attributes=from_attributes, context=context, **kwargs
            )
        problems: list[str] = []
        data = _normalize_top_level(obj, problems)

        def section(model_cls: type[BaseModel], raw: Any, prefix: str) -> tuple[Any, set[str]]:
            if raw is None:
                raw = {}
            if isinstance(raw, model_cls):
                return raw, set()
            if not isinstance(raw, Mapping):
                problems.append(f"{prefix}: must be a mapping, got {type(raw).__name__} {raw!r}")
                return None, set()
            result, errors, dropped = _validate_partially(
                model_cls, raw, prefix, strict=strict, context=context
            )
            problems.extend(errors)
            return result, dropped

        runtime_env, _ = section(RuntimeEnvConfig, data.get("runtime_env"), "runtime_env")
        runtime, rt_dropped = section(RuntimeConfig, data.get("runtime"), "runtime")
        models_raw = data.get("models") or {}
        models: dict[str, ModelConfig] = {}
        models_dropped: dict[str, set[str]] = {}
        if not isinstance(models_raw, Mapping):
            problems.append(f"models: must be a mapping of model name to model config, got {models_raw!r}")
            models_raw = {}
        for name, raw in models_raw.items():
            model, dropped = section(ModelConfig, raw, f"models.{name}")
            if model is not None:
                models[str(name)] = model
                models_dropped[str(name)] = dropped
        if runtime is not None and "generation_batch_size" not in rt_dropped:
            _resolve_generation_batch_size(runtime, models)
        _warn_unknown_model_keys(models)
        problems += _check_sections(runtime, models, [str(n) for n in models_raw], rt_dropped, models_dropped)
        if runtime is not None and runtime_env is not None and not rt_dropped:
            # Extra validators see only fully parsed models (a partly parsed one holds defaults).
            complete = {n: m for n, m in models.items() if not models_dropped[n]}
            partial = cls.model_construct(runtime_env=runtime_env, runtime=runtime, models=complete)
            problems += _run_extra_validators(partial)
        if problems:
            raise ConfigError(list(dict.fromkeys(problems)))
        ctx = dict(context) if isinstance(context, Mapping) else {}
        ctx[_CHECKED] = True
        return super().model_validate(
            {"runtime_env": runtime_env, "runtime": runtime, "models": models},
            strict=strict,
            from_attributes=from_attributes,
            context=ctx,
            **kwargs,
        )

    @classmethod
    def model_validate_json(
        cls,
        json_data: str | bytes | bytearray,
        *,
        strict: bool | None = None,
        context: Any | None = None,
        **kwargs: Any,
    ) -> "ChatLearnConfig":
        """Parse JSON, then validate like :meth:`model_validate` (one ConfigError with every problem)."""
        return cls.model_validate(json.loads(json_data), strict=strict, context=context, **kwargs)


# Functions run at the end of validation; each returns problems as "dotted.path: message" strings.
EXTRA_VALIDATORS: list[Callable[[ChatLearnConfig], list[str]]] = []
