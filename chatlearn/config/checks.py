"""Cross-field checks of a parsed config: ranges, batch arithmetic, devices per model, colocation groups.

These are the checks of ChatLearn's own loader (``Config._validate_params``) plus plain range checks, each
reported as ``"dotted.path: message"``. A check that reads a field which failed to parse is skipped (that
field already has its own problem), so one typo does not cascade into a list of false alarms. What needs
an engine (which models it uses, their modules' arguments, hooks, layouts not supported yet) is in
:mod:`chatlearn.config.engine_checks`.
"""

from collections.abc import Collection, Mapping, Sequence

from chatlearn.config.model import PARALLEL_KEYS, ModelConfig
from chatlearn.config.runtime import (
    CPU_SCHEDULE_STRATEGIES,
    PARAM_SYNC_COMM_TYPES,
    STREAM_DATA_LOADER_TYPES,
    RuntimeConfig,
)

__all__ = ["check_sections"]


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
    if parsed("lora"):
        if m.lora.lora_dim < 1:
            problems.append(f"{pre}.lora.lora_dim: must be >= 1, got {m.lora.lora_dim}")
        if not 0.0 <= m.lora.lora_dropout < 1.0:
            problems.append(f"{pre}.lora.lora_dropout: must be in [0, 1), got {m.lora.lora_dropout}")
    if m.max_token_in_packing < 1 and parsed("max_token_in_packing"):
        problems.append(f"{pre}.max_token_in_packing: must be >= 1, got {m.max_token_in_packing}")
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


def check_sections(
    runtime: RuntimeConfig | None,
    models: Mapping[str, ModelConfig],
    model_names: Sequence[str],
    rt_dropped: Collection[str] = (),
    models_dropped: Mapping[str, Collection[str]] | None = None,
) -> list[str]:
    """Every cross-field problem of the parsed sections. ``model_names`` are all the names the config gave
    (also those whose section failed to parse, so colocation does not call them unknown); ``*_dropped`` are
    the keys that failed to parse, whose checks are skipped."""
    problems: list[str] = []
    models_dropped = models_dropped or {}
    if runtime is not None:
        problems += _check_runtime(runtime, rt_dropped)
        if "colocation" not in rt_dropped:
            problems += _check_colocation(runtime, model_names)
    for name, model in models.items():
        problems += _check_model(name, model, runtime, models_dropped.get(name, ()), rt_dropped)
    return problems
