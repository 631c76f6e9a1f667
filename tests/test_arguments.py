"""The config models against ChatLearn's config reference (config-reference.txt), field by field."""

import json
import os
import pickle
import re
import warnings

import pytest
from pydantic import ValidationError

from chatlearn.config.runtime import AgentConfig, LogArgsConfig, PartialRolloutConfig
from chatlearn.utils.arguments import (
    BatchGenerationConfig,
    ChatLearnConfig,
    ConfigError,
    ConfigWarning,
    LoraConfig,
    ModelConfig,
    RuntimeConfig,
    RuntimeEnvConfig,
)

CWD = object()  # marker: default is os.getcwd()

# Every field of /work/shared/reference/config-reference.txt with its documented default.
REFERENCE = {
    RuntimeEnvConfig: {
        "pip": [],
        "py_modules": [],
        "working_dir": CWD,
        "platform": "",
        "excludes": [],
    },
    RuntimeConfig: {
        "num_episode": 5000,
        "sample_per_episode": 1000,
        "num_training_epoch": 1,
        "generation_batch_size": 2,
        "train_micro_batch_size": 2,
        "train_global_batch_size": None,
        "save_episode_interval": None,
        "log_interval": 1,
        "data_path": None,
        "colocation": [],
        "eval_episode_interval": 0,
        "enable_resume_training": True,
        "data_checkpoint_path": None,
        "max_data_ckpt_nums": None,
        "load_data_checkpoint_iteration": None,
        "stream_data_loader_type": "fixed",
        "debug": False,
        "nsys": False,
        "profiler_dir": None,
        "coalesce_param": True,
        "coalesced_buffer_mb": 100,
        "concurrent_comm": True,
        "param_sync_comm_type": "broadcast",
        "param_sync_max_workers": None,
        "max_relay_episode": 0,
        "relay_episode_offset": 0,
        "consumed_samples": 0,
        "concurrent_setup": False,
        "bucket_size_mb_in_memory_manager": 1024,
        "free_sync_collective_group": False,
        "cpu_schedule_strategy": "SPREAD",
        "exp_name": "CHATLEARN",
        "output_dir": "./",
    },
    ModelConfig: {
        "num_device": 0,
        "num_gpu": 0,
        "num_cpu": 0,
        "gpu_per_process": None,
        "cpu_per_process": None,
        "num_replica": 1,
        "trainable": False,
        "tensor_model_parallel_size": None,
        "pipeline_model_parallel_size": None,
        "zero_size": None,
        "model_config_file": "",
        "config_dir": "",
        "model_type": "",
        "generation_batch_size": -1,
        "offload_optimizer_states": False,
        "sync_frequency": 1,
        "offload_weights": False,
        "free_grad_buffers": False,
        "free_memory": False,
        # The reference prints the class attributes (None); ChatLearn's __init__ sets {} and fresh
        # LoraConfig()/BatchGenerationConfig() instances, which is what we use as defaults.
        "args_dict": {},
        "lora": LoraConfig(),
        "batch_generation": BatchGenerationConfig(),
    },
    BatchGenerationConfig: {"ranking": False, "min_prompt_length": 0},
    LoraConfig: {
        "enable_lora": False,
        "part_module_name": None,
        "lora_dim": 8,
        "lora_dropout": 0.0,
        "lora_scaling": 1.0,
        "lora_layer": "ColumnParallelLinear,Embedding,LinearLayer,RowParallelLinear,VocabParallelEmbedding",
        "column_only_qkv": False,
    },
}

# Runtime keys ChatLearn reads as user extras (runtime_args.get) or added after 1.0.2, declared here as typed
# fields after the reference's own, with ChatLearn's defaults where ChatLearn has one (data_shuffle: 1.0.3's;
# packing and max_token_in_packing: HEAD's).
DECLARED_EXTRAS = {
    RuntimeConfig: {
        "seed": 42,
        "engine": "rlhf",
        "rollout_engine": "hf",  # HEAD's default is vllm (supported here, the CPU build: not the default)
        "max_staleness": 0,  # pipelined episodes (the peers' name, TRL's max_staleness); 0 is ChatLearn's episode
        "use_partial_rollout": False,  # HEAD's partial rollouts
        "task_type": "chat",  # HEAD's key: chat, or agent (multi-turn rollouts with an environment)
        "agent": AgentConfig(),  # runtime.agent: the environment and the turn limits (not in ChatLearn)
        "dynamic_sampling": False,  # DAPO's dynamic sampling (verl's filter_groups)
        "max_sampling_rounds": 3,
        # HEAD's PartialRolloutManagerConfig defaults, but mini_response_per_prompt (HEAD: 16): unset means
        # num_inference_per_prompt - 1, the one value supported (a group trains whole)
        "partial_rollout_manager_config": PartialRolloutConfig(max_rollout_round=2, rollout_ratio=[0.5, 0.5],
                                                               mini_response_per_prompt=None),
        "data_shuffle": True,
        "eval_data_path": None,
        "eval_post_process_fn": None,
        "relay_sample_fn": None,
        "enable_eval_before_training": False,
        # ChatLearn HEAD's LogConfig (its trackers), plus MLflow's fields
        "log_args_dict": LogArgsConfig(),
        "max_restarts": 3,
        "stage_timeout_s": 3600.0,
        "trace_samples": "all",  # each episode's samples in run_dir/traces (issue 47; ChatLearn keeps none)
        "stall_factor": 5.0,  # the Prefect event chatlearn.run.stalled (issue 47)
        "alerts": [],  # conditions on the metrics, the Prefect event chatlearn.alert (issue 47)
        "resume_with_changes": False,
    },
    ModelConfig: {
        "packing": False,
        "max_token_in_packing": 32768,
    },
}
ALL_FIELDS = {cls: {**fields, **DECLARED_EXTRAS.get(cls, {})} for cls, fields in REFERENCE.items()}

# Values that validation derives from the defaults (documented ChatLearn load-time behaviour).
RESOLVED_ON_INSTANCE = {
    RuntimeConfig: {"train_global_batch_size": 2, "output_dir": os.path.join("./", "CHATLEARN")},
    ModelConfig: {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "zero_size": 1},
}


def _declared_default(cls, name):
    field = cls.model_fields[name]
    return field.default_factory() if field.default_factory is not None else field.default


@pytest.mark.parametrize("cls", list(REFERENCE), ids=lambda c: c.__name__)
def test_fields_match_reference_exactly(cls):
    assert list(cls.model_fields) == list(REFERENCE[cls]) + list(DECLARED_EXTRAS.get(cls, {}))


def test_reference_table_is_the_shared_reference(shared_reference):
    # the table above is config-reference.txt: every class's fields, in its order
    documented: dict[str, list[str]] = {}
    current = None
    with open(os.path.join(shared_reference, "config-reference.txt"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("class chatlearn.utils.arguments."):
                current = documented.setdefault(line.strip().rsplit(".", 1)[1], [])
            elif current is not None and re.match(r"^[a-z_]+(: [^=]+)? = ", line):
                current.append(line.split(":")[0].split(" = ")[0].strip())
    assert {cls.__name__: list(fields) for cls, fields in REFERENCE.items()} == documented


@pytest.mark.parametrize(
    "cls,name,expected",
    [(cls, name, value) for cls, fields in ALL_FIELDS.items() for name, value in fields.items()],
    ids=lambda v: v.__name__ if isinstance(v, type) else str(v)[:20],
)
def test_declared_defaults_match_reference(cls, name, expected):
    if expected is CWD:
        expected = os.getcwd()
    assert _declared_default(cls, name) == expected
    instance_value = getattr(cls(), name)
    resolved = RESOLVED_ON_INSTANCE.get(cls, {})
    assert instance_value == resolved.get(name, expected)


@pytest.mark.parametrize("cls", list(REFERENCE), ids=lambda c: c.__name__)
def test_every_field_is_documented_in_the_json_schema(cls):
    props = cls.model_json_schema()["properties"]
    for name in REFERENCE[cls]:
        assert props[name].get("description"), f"{cls.__name__}.{name} has no description"


def test_descriptions_come_from_the_reference():
    assert RuntimeConfig.model_fields["num_episode"].description.startswith("[required] number of episodes.")
    assert "relay all episodes" in RuntimeConfig.model_fields["max_relay_episode"].description
    assert LoraConfig.model_fields["lora_dim"].description.startswith("The rank value of the LoRA")
    assert ModelConfig.model_fields["free_memory"].description.startswith("overall switch")
    schema = ChatLearnConfig.model_json_schema()
    assert set(schema["properties"]) == {"runtime_env", "runtime", "models", "deployment"}
    assert json.dumps(schema)  # serializable, so it can become a Prefect UI form


def test_dump_has_every_field_with_defaults():
    cfg = ChatLearnConfig.model_validate({"models": {"policy": {"num_gpu": 1}}})
    dumped = cfg.model_dump(mode="json")
    assert set(dumped) == {"runtime_env", "runtime", "models", "deployment"}
    assert set(dumped["runtime_env"]) == set(REFERENCE[RuntimeEnvConfig])
    assert set(dumped["runtime"]) == set(ALL_FIELDS[RuntimeConfig])
    assert set(dumped["models"]["policy"]) == set(ALL_FIELDS[ModelConfig])
    assert set(dumped["models"]["policy"]["lora"]) == set(REFERENCE[LoraConfig])
    assert dumped["runtime"]["num_episode"] == 5000
    assert dumped["runtime"]["train_global_batch_size"] == 2
    assert dumped["runtime"]["output_dir"] == "./CHATLEARN"
    assert dumped["runtime_env"]["working_dir"] == os.getcwd()
    assert dumped["models"]["policy"]["gpu_per_process"] == 1
    assert dumped["models"]["policy"]["generation_batch_size"] == 2
    assert dumped["models"]["policy"]["lora"]["lora_dim"] == 8


def test_round_trip_of_resolved_dump():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = ChatLearnConfig.model_validate(
            {
                "runtime_env": {"platform": "DLC", "my_env_key": 1},
                "runtime": {"generation_batch_size": 4, "colocation": ["policy,trainer"], "custom": "x"},
                "models": {
                    "policy": {"num_device": 4, "tensor_model_parallel_size": 2, "extra_arg": 5},
                    "trainer": {"num_gpu": 4, "trainable": True, "free_memory": True},
                    "cpu": {"num_cpu": 4, "cpu_per_process": 2},
                },
            }
        )
        again = ChatLearnConfig.model_validate(cfg.model_dump(mode="json"))
        again_json = ChatLearnConfig.model_validate_json(cfg.model_dump_json())
    assert again == cfg
    assert again_json == cfg
    assert again.model_dump(mode="json") == cfg.model_dump(mode="json")
    assert list(again.models) == ["policy", "trainer", "cpu"]
    assert again.runtime.output_dir == "./CHATLEARN"


def test_runtime_get_returns_extras_and_fields():
    rt = RuntimeConfig.model_validate({"unknown_args": "test_unknown", "eval_data_num_limit": 128})
    assert rt.get("unknown_args") == "test_unknown"
    assert rt.get("eval_data_num_limit") == 128
    assert rt.get("num_episode") == 5000
    assert rt.get("missing") is None
    assert rt.get("missing", 7) == 7
    assert rt.model_dump()["unknown_args"] == "test_unknown"


def test_runtime_env_get_and_extras():
    env = RuntimeEnvConfig.model_validate({"platform": "DLC", "env_vars": {"A": "1"}})
    assert env.get("env_vars") == {"A": "1"}
    assert env.get("platform") == "DLC"
    assert env.get("nope", "d") == "d"
    assert env.model_dump(mode="json")["env_vars"] == {"A": "1"}


def test_unknown_model_keys_are_kept_with_a_warning():
    with pytest.warns(ConfigWarning, match=r"models\.policy\.some_arg"):
        cfg = ChatLearnConfig.model_validate({"models": {"policy": {"num_gpu": 1, "some_arg": 3}}})
    assert cfg.models["policy"].get("some_arg") == 3
    assert cfg.model_dump()["models"]["policy"]["some_arg"] == 3


@pytest.mark.parametrize(
    "given,gpu",
    [({"num_device": 4}, 4), ({"num_gpu": 2}, 2), ({"num_device": 4, "num_gpu": 2}, 2), ({}, 0)],
)
def test_num_device_is_legacy_alias_of_num_gpu(given, gpu):
    model = ModelConfig.model_validate(given)
    assert model.num_gpu == gpu
    assert model.num_device == gpu


@pytest.mark.parametrize(
    "trainable,expected",
    [(False, (True, False, False)), (True, (True, True, True))],
)
def test_free_memory_switches_on_offload_flags(trainable, expected):
    model = ModelConfig(num_gpu=1, trainable=trainable, free_memory=True)
    assert (model.offload_weights, model.free_grad_buffers, model.offload_optimizer_states) == expected
    off = ModelConfig(num_gpu=1, trainable=trainable)
    assert (off.offload_weights, off.free_grad_buffers, off.offload_optimizer_states) == (False,) * 3


def test_train_global_batch_size_defaults_to_micro():
    assert RuntimeConfig(train_micro_batch_size=8).train_global_batch_size == 8
    assert RuntimeConfig(train_micro_batch_size=8, train_global_batch_size=32).train_global_batch_size == 32


def test_per_process_and_parallel_defaults():
    gpu = ModelConfig(num_gpu=2)
    assert (gpu.gpu_per_process, gpu.cpu_per_process) == (1, None)
    assert (gpu.tensor_model_parallel_size, gpu.pipeline_model_parallel_size, gpu.zero_size) == (1, 1, 1)
    cpu = ModelConfig(num_cpu=3)
    assert (cpu.gpu_per_process, cpu.cpu_per_process) == (None, 1)
    assert ModelConfig(num_gpu=2, gpu_per_process=2).gpu_per_process == 2


@pytest.mark.parametrize(
    "given,replicas,dp",
    [
        ({"num_gpu": 8, "tensor_model_parallel_size": 2}, 4, 1),
        ({"num_gpu": 8, "tensor_model_parallel_size": 4}, 2, 1),
        ({"num_gpu": 8, "pipeline_model_parallel_size": 4}, 2, 1),
        ({"num_gpu": 8, "zero_size": 8}, 1, 8),
        ({"num_gpu": 8, "zero_size": 4}, 2, 4),
        (
            {
                "num_gpu": 8,
                "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
                "trainable": True,
            },
            1,
            2,
        ),
        ({"num_gpu": 8, "trainable": True}, 1, 8),
        ({"num_cpu": 4}, 4, 1),
        ({"num_cpu": 4, "cpu_per_process": 2}, 2, 1),
        ({"num_cpu": 4, "num_replica": 3}, 3, 1),
        ({"num_gpu": 8, "num_replica": 3}, 8, 1),  # user value only honoured for CPU models
    ],
)
def test_num_replica_is_derived(given, replicas, dp):
    model = ModelConfig.model_validate(given)
    assert model.num_replica == replicas
    assert model.data_parallel_size == dp


def test_generation_batch_size_falls_back_to_runtime():
    cfg = ChatLearnConfig.model_validate(
        {
            "runtime": {"generation_batch_size": 8},
            "models": {
                "a": {"num_gpu": 1},
                "b": {"num_gpu": 1, "generation_batch_size": 0},
                "c": {"num_gpu": 1, "generation_batch_size": None},
                "d": {"num_gpu": 1, "generation_batch_size": 3},
            },
        }
    )
    assert {n: m.generation_batch_size for n, m in cfg.models.items()} == {"a": 8, "b": 8, "c": 8, "d": 3}


def test_run_dir_and_output_dir_get_exp_name_once():
    rt = RuntimeConfig(output_dir="out", exp_name="exp1")
    assert rt.output_dir == "out/exp1"
    assert rt.run_dir == "out/exp1"
    again = RuntimeConfig.model_validate(rt.model_dump())
    assert again.output_dir == "out/exp1"
    assert RuntimeConfig(output_dir="out/exp1/", exp_name="exp1").run_dir == "out/exp1/"
    assert RuntimeConfig(output_dir="exp1x", exp_name="exp1").run_dir == "exp1x/exp1"
    cfg = ChatLearnConfig.model_validate({"runtime": {"output_dir": "runs", "exp_name": "e"}})
    assert cfg.runtime.run_dir == cfg.runtime.output_dir == os.path.join("runs", "e")


def test_none_is_refused_where_the_default_is_not_none():
    # ${VAR} with VAR unset gives None; ChatLearn 1.0.2 refuses it for a field whose default is not None
    # (its type check), and so do we, instead of silently running with the default.
    with pytest.raises(ValidationError) as info:
        RuntimeConfig.model_validate({"output_dir": None, "exp_name": None, "num_episode": None})
    assert {e["loc"][0] for e in info.value.errors()} == {"output_dir", "exp_name", "num_episode"}
    with pytest.raises(ValidationError):
        ModelConfig.model_validate({"num_gpu": None})
    rt = RuntimeConfig.model_validate({"data_path": None, "save_episode_interval": None})  # None defaults
    assert rt.data_path is None and rt.save_episode_interval is None


def test_choices_are_normalized_case_insensitively():
    rt = RuntimeConfig(
        stream_data_loader_type="DYNAMIC", param_sync_comm_type="P2P", cpu_schedule_strategy="pack"
    )
    assert (rt.stream_data_loader_type, rt.param_sync_comm_type, rt.cpu_schedule_strategy) == (
        "dynamic",
        "p2p",
        "PACK",
    )


def test_colocation_groups_forms():
    rt = RuntimeConfig(colocation=["policy, reference", ["reward", "value"]])
    assert rt.colocation == ["policy,reference", "reward,value"]
    assert rt.colocation_groups == [["policy", "reference"], ["reward", "value"]]


def test_rlhf_is_a_deprecated_alias_of_runtime():
    with pytest.warns(ConfigWarning, match="rlhf"):
        cfg = ChatLearnConfig.model_validate({"rlhf": {"num_episode": 7, "sample_per_episode": 8}})
    assert cfg.runtime.num_episode == 7
    with pytest.warns(ConfigWarning, match="rlhf"):
        both = ChatLearnConfig.model_validate({"rlhf": {"num_episode": 7}, "runtime": {"num_episode": 3}})
    assert both.runtime.num_episode == 3


def test_unknown_top_level_key_is_ignored_with_warning():
    with pytest.warns(ConfigWarning, match="whatever"):
        cfg = ChatLearnConfig.model_validate({"whatever": 1})
    assert "whatever" not in cfg.model_dump()


def test_models_keep_insertion_order():
    names = ["z", "a", "m", "b"]
    cfg = ChatLearnConfig.model_validate({"models": {n: {"num_gpu": 1} for n in names}})
    assert list(cfg.models) == names


def test_types_are_coerced_like_yaml_users_expect():
    lora = LoraConfig(lora_dropout=0, enable_lora="True")
    assert lora.lora_dropout == 0.0 and isinstance(lora.lora_dropout, float)
    assert lora.enable_lora is True
    assert RuntimeConfig(exp_name=2024).exp_name == "2024"


def test_config_error_is_a_value_error_and_pickles():
    err = ConfigError(["a.b: first", "c: second"])
    assert isinstance(err, ValueError)
    assert str(err) == "a.b: first\nc: second"
    copy = pickle.loads(pickle.dumps(err))
    assert copy.problems == ["a.b: first", "c: second"]
    assert ConfigError("x: y").problems == ["x: y"]
