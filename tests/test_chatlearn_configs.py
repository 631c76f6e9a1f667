"""ChatLearn's own published configs resolve here as ChatLearn 1.0.2's own loader resolves them.

`tests/data/chatlearn_1_0_2_loader.json` records what ChatLearn's loader (v1.0.2, run unmodified) accepted,
refused and resolved for each top-level config in `../shared/reference/chatlearn-1.0.2-configs`, with the
environment its own run scripts set and with none. Each case loads the same file from the same folder with
the same environment through `chatlearn.config.load_config` and compares. Where we deliberately differ, the
difference is listed here and in the docs (docs/pages/configuration.md, "Where we differ from ChatLearn 1.0.2").
"""

import json
import math
import os
import warnings
from pathlib import Path

import pytest

from chatlearn.cli import main
from chatlearn.config import ConfigError, ConfigWarning, load_config
from chatlearn.config.model import PARALLEL_KEYS

REPO = Path(__file__).resolve().parents[1]
TRUTH = json.loads((REPO / "tests" / "data" / "chatlearn_1_0_2_loader.json").read_text())["configs"]

MODEL_FIELDS = ["num_gpu", "num_cpu", "gpu_per_process", "cpu_per_process", "num_replica", "trainable",
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "zero_size", "generation_batch_size",
                "sync_frequency", "free_memory", "offload_weights", "offload_optimizer_states", "free_grad_buffers",
                "model_type"]


def load_like_chatlearn(root: Path, case: dict, env: dict, monkeypatch):
    for name in {n for c in TRUTH for n in c["env"]}:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(root / case["cwd"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(case["config_arg"])


def expected_args_value(value):
    """Our YAML reads unquoted `5e-7` as the float it is (YAML 1.2, and ChatLearn 1.0.3); 1.0.2 kept the text."""
    if isinstance(value, dict):
        return {k: expected_args_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expected_args_value(v) for v in value]
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        if "e" in value.lower() and not math.isnan(number):
            return number
    return value


@pytest.mark.parametrize("case", TRUTH, ids=[c["config"] for c in TRUTH])
def test_resolves_like_chatlearn_with_its_scripts_environment(case, reference_configs, monkeypatch):
    assert case["accepted"]  # every published config loads in ChatLearn with its script's environment
    cfg = load_like_chatlearn(reference_configs, case, case["env"], monkeypatch)
    rt = cfg.runtime
    for key, value in case["runtime"].items():
        ours = getattr(rt, key)
        if key == "output_dir":  # ChatLearn joins with "/" and so writes ".//CHATLEARN"; the same folder
            assert os.path.normpath(ours) == os.path.normpath(value), key
        elif key == "colocation":
            assert rt.colocation_groups == value
        else:
            assert ours == value, key
    for key, value in case["runtime_extras"].items():
        assert rt.get(key) == value, key
    for key, value in case["runtime_env"].items():
        assert getattr(cfg.runtime_env, key) == value, key
    assert list(cfg.models) == list(case["models"])
    for name, expected in case["models"].items():
        model = cfg.models[name]
        cpu_only = not expected["num_gpu"] and expected["num_cpu"]
        for key in MODEL_FIELDS:
            if cpu_only and key in PARALLEL_KEYS:
                # deliberate: a model file's TP/PP/zero (its GPU backend's) does not split a CPU-only model's
                # processes into replicas (see chatlearn.config.loader._sync_parallel_sizes)
                assert getattr(model, key) == 1, f"models.{name}.{key}"
                continue
            assert getattr(model, key) == expected[key], f"models.{name}.{key}"
        assert model.lora.model_dump() == expected["lora"], f"models.{name}.lora"
        assert model.batch_generation.ranking == expected["batch_generation.ranking"]
        assert model.batch_generation.min_prompt_length == expected["batch_generation.min_prompt_length"]
        # ChatLearn leaves a model file's `includes:` list in args_dict; we merge the files and drop the key
        theirs = {k: expected_args_value(v) for k, v in expected["args_dict"].items() if k != "includes"}
        assert model.args_dict == theirs, f"models.{name}.args_dict"


@pytest.mark.parametrize("case", TRUTH, ids=[c["config"] for c in TRUTH])
def test_without_environment_refuses_what_chatlearn_refuses(case, reference_configs, monkeypatch):
    if case["no_env"]["accepted"]:
        cfg = load_like_chatlearn(reference_configs, case, {}, monkeypatch)
        assert cfg.models
        return
    with pytest.raises(ConfigError) as info:
        load_like_chatlearn(reference_configs, case, {}, monkeypatch)
    refusal = case["no_env"]["refusal"]
    problems = info.value.problems
    # ChatLearn stops at its first failed assert; we name that field among all the problems
    if ".output_dir should be" in refusal:
        assert "runtime.output_dir: ${output_dir} is not set and has no default" in problems
    elif ".exp_name should be" in refusal:
        assert "runtime.exp_name: ${exp_name} is not set and has no default" in problems
    elif "ModelConfig.num_gpu" in refusal:
        assert "models.policy.num_gpu: ${num_gpu_policy} is not set and has no default" in problems
    else:
        assert "num_gpu must be divisible by tensor_model_parallel_size" in refusal
        assert "models.reward.num_gpu: 1 is not divisible by tensor_model_parallel_size * " \
               "pipeline_model_parallel_size = 8*1 = 8" in problems


def test_chatlearn_config_prints_a_published_config(reference_configs, monkeypatch, capsys):
    case = next(c for c in TRUTH if c["config"].endswith("llama2/vllm_rlhf.yaml"))
    for name, value in case["env"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(reference_configs / case["cwd"])
    assert main(["config", case["config_arg"]]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["models"]["policy"]["num_replica"] == case["models"]["policy"]["num_replica"]
    assert printed["runtime"]["sample_per_episode"] == case["runtime"]["sample_per_episode"]
    # the engine's checks are another matter: Megatron/vLLM modules are not built in here
    assert main(["config", "--check", case["config_arg"]]) == 2
