"""``models.<name>``: ChatLearn 1.0.2's ``ModelConfig`` with its ``LoraConfig`` and ``BatchGenerationConfig``,
field for field, and the replica arithmetic that follows from a model's resources."""

from typing import Any, NamedTuple

from pydantic import ConfigDict, Field, model_validator

from chatlearn.config.sections import Section

__all__ = ["PARALLEL_KEYS", "BatchGenerationConfig", "LoraConfig", "ModelConfig", "ReplicaLayout"]

# Keys a model's backend config file (``model_config_file``) may set that override ModelConfig fields.
PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "zero_size")


class ReplicaLayout(NamedTuple):
    """How a model's resources split: ``replicas`` x ``processes`` per replica, each process asking for
    ``gpus`` GPUs (GPU model) or ``cpus`` CPUs (CPU-only model)."""

    replicas: int
    processes: int
    gpus: float
    cpus: float


class BatchGenerationConfig(Section):
    """Config for batch generation ranking and memory-efficiency. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    ranking: bool = Field(default=False, description="[optional] sort prompts by length each episode.")
    min_prompt_length: int = Field(
        default=0, description="[optional] min prompt length in the first stage of batch generation."
    )


class LoraConfig(Section):
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


class ModelConfig(Section):
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
        "// (TP * PP * zero_size) unless given explicitly. Derived; trainable models always run as one replica "
        "(num_replica = 1, their GPUs form data-parallel ranks).",
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
    # ChatLearn HEAD's padding-free training (after 1.0.2's fields)
    packing: bool = Field(
        default=False,
        description="[optional] padding-free forwards: score and train on packed sequences (each sequence's real "
        "tokens one after another in one row, its own position ids, attention that cannot cross sequences), "
        "with training micro-batches cut by tokens (max_token_in_packing) instead of train_micro_batch_size; "
        "the step's loss normalisation is unchanged. Modules and layouts that cannot pack refuse it.",
    )
    max_token_in_packing: int = Field(
        default=32768,
        description="[optional] with packing: the most tokens (prompt + response, real tokens only) one packed "
        "micro-batch or scoring forward holds; a longer single sample runs alone.",
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
            # a CPU process plays a device: a replica is TP x PP x zero_size processes of cpu_per_process cores
            per_replica = tp * pp * zero if tp * pp * zero > 0 else 1
            return max(1, self.num_cpu // self.cpu_per_process // per_replica)
        return self.num_replica

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks inside one replica: GPUs per replica // (TP * PP); 1 for CPU models."""
        if self.num_gpu <= 0:
            return 1
        per_replica = self.num_gpu // max(self.num_replica, 1)
        tp_pp = (self.tensor_model_parallel_size or 1) * (self.pipeline_model_parallel_size or 1)
        return max(per_replica // max(tp_pp, 1), 1)

    @property
    def layout(self) -> ReplicaLayout:
        """Replicas, processes per replica and each process's devices (ChatLearn's resource arithmetic)."""
        replicas = 1 if self.trainable else max(1, int(self.num_replica or 1))
        if self.num_gpu > 0:
            per_process = self.gpu_per_process or 1
            return ReplicaLayout(replicas, max(1, self.num_gpu // replicas // per_process), float(per_process), 0.0)
        per_process = self.cpu_per_process or 1
        return ReplicaLayout(replicas, max(1, self.num_cpu // replicas // per_process), 0.0, float(per_process))
