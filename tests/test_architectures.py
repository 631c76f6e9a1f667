"""Real architectures (issue 28 item 4): tiny random builds of the Llama, Qwen2, Qwen3 and Mistral transformers
classes with their families' traits scaled down (configs/tiny_*.yaml), through the real code.

In-process (seconds): each build's traits; the LoRA target mapping, the TP plan, the per-head parameters whose
TP gradients are summed (Qwen3's q/k norms); the combinations that cannot work refused naming their field (a TP
size that splits a head, packing or the continuous engine on a sliding-window model). Layouts of these models
(Qwen3 TP 2 and Mistral PP 2 give one process's gradients): tests/test_parallel.py; tied round trips of the
Qwen3: tests/test_tied_weights.py.

Whole runs (integration), four in all: PPO on the Qwen3 and the Qwen2, GRPO on the Mistral and the Llama, two
episodes of 16 samples each, every model of the run (value networks too) of that family, each with LoRA on the
policy trainer and the inference policy in TP 2 with the sync's debug check on (every tensor a TP rank receives
is digest-checked against the trainer's), the merged final policy loaded back as that family's class. They run
in this process on the session's Ray (the command's own process is not their point: tests/test_outside_repo.py,
tests/test_resume.py). More Llama and Qwen2 runs: tests/test_engine_runs.py, tests/test_qwen2_runs.py.
"""

import json
import time

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from chatlearn.config import ConfigError, load_config
from chatlearn.data.preflight import check_model_files
from chatlearn.models.hf.lora import lora_target_modules
from chatlearn.models.hf.policy import PolicyInference
from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer
from chatlearn.models.hf.tiny import CHARACTERS, SPECIAL_TOKENS, TinyModelSpec
from chatlearn.models.parallel import tp_partial_parameters, tp_plan
from chatlearn.utils.arguments import LoraConfig, ModelConfig, RuntimeConfig
from tests.conftest import train_here

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM"}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(params=ARCHS)
def arch_dir(request):
    fixture = "tiny_model_dir" if request.param == "llama" else f"tiny_{request.param}_dir"
    return request.param, request.getfixturevalue(fixture)


def test_each_tiny_build_has_its_familys_traits(arch_dir):
    arch, path = arch_dir
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg, attn = model.config, model.model.layers[0].self_attn
    assert type(model).__name__ == CLASSES[arch]
    assert AutoTokenizer.from_pretrained(path).eos_token_id == cfg.eos_token_id
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim)
    if arch == "llama":
        assert heads == (4, 4, 64) and not tied
    elif arch == "qwen2":
        assert heads == (4, 2, 64) and tied and attn.q_proj.bias is not None
    elif arch == "qwen3":  # q/k RMSNorm per head; 4 x 128 = 512 wide attention over a 256 residual stream
        assert heads == (4, 2, 128) and tied and attn.q_proj.bias is None
        assert attn.q_proj.out_features == 2 * cfg.hidden_size and attn.q_norm.weight.shape == (128,)
    else:  # 4 query heads per KV head, an 8-token window
        assert heads == (8, 2, 32) and not tied and cfg.sliding_window == 8

    # the tokenizer: ours (one token per character) or the family's format, with its chat template
    tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "max 3 7 ?"}]
    if arch in ("qwen3", "mistral"):
        assert len(tok) > 200 and tok.padding_side == "left"
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = tok("max 3 7 ?").input_ids
        assert tok.decode(ids, skip_special_tokens=True).strip() == "max 3 7 ?"
        assert [t for t in tok.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)] in (["3", "7"],)
    if arch == "qwen3":
        assert text == "<|im_start|>user\nmax 3 7 ?<|im_end|>\n<|im_start|>assistant\n"
        assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    elif arch == "mistral":
        assert text == "[INST] max 3 7 ? [/INST]" and tok.convert_ids_to_tokens(tok("x").input_ids)[0] == "<s>"
        assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("</s>", "<unk>", "<s>")
    else:  # the character tokenizer
        assert len(tok) == len(SPECIAL_TOKENS) + len(CHARACTERS) and not tok.chat_template


def test_lora_targets_and_the_tp_plan_take_each_family(arch_dir):
    arch, path = arch_dir
    model = AutoModelForCausalLM.from_pretrained(path)
    layers = range(model.config.num_hidden_layers)
    projections = [f"model.layers.{i}.{p}" for i in layers for p in PROJECTIONS]
    lora = LoraConfig(enable_lora=True, lora_layer="ColumnParallelLinear,RowParallelLinear")
    assert lora_target_modules(model, lora) == projections
    everything = lora_target_modules(model, LoraConfig(enable_lora=True))  # every linear and embedding
    tied = model.config.tie_word_embeddings
    assert everything == (projections if tied else ["model.embed_tokens", *projections, "lm_head"])
    assert not [n for n in everything if "norm" in n]
    plan = tp_plan(model)
    assert sorted(plan) == sorted(projections)
    # Qwen3's per-head norms: whole on every TP rank, each rank's gradient from its own heads only
    norms = {f"model.layers.{i}.self_attn.{n}.weight" for i in layers for n in ("q_norm", "k_norm")}
    assert tp_partial_parameters(model) == (norms if arch == "qwen3" else set())


def test_a_sliding_window_is_only_mistrals():
    with pytest.raises(ValueError, match="sliding_window is Mistral's"):
        TinyModelSpec(architecture="qwen3", sliding_window=8)


def run_config(path: str, tp: int, **runtime):
    models = {name: {"num_cpu": tp, "tensor_model_parallel_size": tp, "trainable": name == "ppo_policy",
                     "args_dict": {"model_path": path}} for name in ("policy", "ppo_policy")}
    return load_config({"models": models, "runtime": {"engine": "grpo", **runtime}}, checks=[])


@pytest.mark.parametrize("arch, tp, field", [("qwen2", 4, "num_key_value_heads"), ("mistral", 4, "num_key_value_heads"),
                                             ("mistral", 3, "num_attention_heads")])
def test_a_tp_size_that_splits_a_head_is_a_config_error_naming_the_field(request, arch, tp, field):
    cfg = run_config(request.getfixturevalue(f"tiny_{arch}_dir"), tp)
    with pytest.raises(ConfigError) as err:
        check_model_files(cfg, {"policy": PolicyInference("policy"), "ppo_policy": PPOPolicyTrainer("ppo_policy")})
    text = str(err.value)
    assert f"models.policy.tensor_model_parallel_size: {tp} does not divide" in text and field in text
    assert "models.ppo_policy.tensor_model_parallel_size" in text
    ok = run_config(request.getfixturevalue(f"tiny_{arch}_dir"), 2)
    check_model_files(ok, {"policy": PolicyInference("policy")})  # 2 divides both


@pytest.mark.parametrize("module_class, field, runtime", [
    (PolicyInference, "runtime.rollout_engine: 'continuous'", {"rollout_engine": "continuous"}),
    (PPOPolicyTrainer, "models.ppo_policy.packing: true", {}),
])
def test_what_ignores_a_sliding_window_refuses_the_mistral(tiny_mistral_dir, tiny_qwen3_dir, tmp_path, module_class,
                                                           field, runtime):
    name = "ppo_policy" if module_class is PPOPolicyTrainer else "policy"
    for path, refused in ((tiny_mistral_dir, True), (tiny_qwen3_dir, False)):  # Qwen3: no window in effect
        module = module_class(name)
        module.bind(ModelConfig(num_cpu=1, trainable=name == "ppo_policy", packing=not runtime,
                                args_dict={"model_path": path}),
                    RuntimeConfig(output_dir=str(tmp_path), exp_name="sw", **runtime), 0, seed=1)
        if refused:
            with pytest.raises(ValueError, match="sliding_window 8") as err:
                module.setup()
            assert str(err.value).startswith(field)
        else:
            module.setup()


# -- whole runs -------------------------------------------------------------------------------------------------
SMALL = ["runtime.num_episode=2", "runtime.sample_per_episode=16", "runtime.generation_batch_size=8",
         "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.save_episode_interval=2",
         "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false", "runtime.debug=true",
         "models.policy.tensor_model_parallel_size=2", "models.policy.num_cpu=2", "models.ppo_policy.num_cpu=1",
         "models.ppo_policy.lora.enable_lora=true", "models.ppo_policy.lora.lora_dim=8",
         "models.ppo_policy.lora.lora_layer=ColumnParallelLinear,RowParallelLinear"]
RUNS = {"ppo": ("configs/default.yaml", ("policy", "reference", "value", "ppo_policy", "ppo_value")),
        "grpo": ("configs/grpo.yaml", ("policy", "reference", "ppo_policy"))}


# every family once, each algorithm on two of them (the one code path both share is the family's model class);
# Qwen2's GRPO with LoRA and a TP 2 policy is tests/test_qwen2_runs.py's run, Llama's PPO the default everywhere
PAIRS = [("qwen3", "ppo"), ("qwen2", "ppo"), ("mistral", "grpo"), ("llama", "grpo")]
FIXTURES = {"llama": "tiny_model_dir"}  # the default's Llama; the others tiny_<arch>_dir
ENV = {"llama": "CHATLEARN_TINY_MODEL_DIR"}


@pytest.mark.integration
@pytest.mark.parametrize(("arch", "algorithm"), PAIRS)
def test_two_episodes_with_lora_and_a_tp2_policy(prefect_api, ray_session, request, tiny_model_dir, tmp_path,
                                                 monkeypatch, arch, algorithm):
    path = request.getfixturevalue(FIXTURES.get(arch, f"tiny_{arch}_dir"))
    config, models = RUNS[algorithm]
    exp = f"{algorithm}-{arch}"
    args = [config, *SMALL, f"runtime.exp_name={exp}",
            *(f"models.{m}.model_config_file=tiny_{arch}.yaml" for m in models),
            *(f"models.{m}.cpu_per_process=1" for m in (*models, "reward"))]
    start = time.monotonic()
    train_here(args, tmp_path, tiny_model_dir, monkeypatch,
               **{ENV.get(arch, f"CHATLEARN_TINY_{arch.upper()}_DIR"): path})
    print(f"{exp}: {time.monotonic() - start:.1f} s")
    run = tmp_path / exp
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [1, 2]
    ranks = json.loads((run / "placement.json").read_text())["ranks"]
    assert [len(rep) for rep in ranks["policy"]] == [2]  # one replica in TP 2

    start_model = AutoModelForCausalLM.from_pretrained(path)
    final = AutoModelForCausalLM.from_pretrained(run / "final" / "policy")
    assert type(final).__name__ == CLASSES[arch]
    traits = ("num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window", "tie_word_embeddings")
    assert [getattr(final.config, t, None) for t in traits] == [getattr(start_model.config, t, None) for t in traits]
    adapters = run / "checkpoints" / "ppo_policy" / "iter_0000002"
    assert adapters.is_dir()
    # LoRA trained the projections (merged into the export) and nothing else
    before, after = start_model.state_dict(), final.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(any(p in k for p in PROJECTIONS) for k in changed)


# -- the GPU recipe, on CPU ---------------------------------------------------------------------------------------
RECIPE = "configs/grpo_gsm8k_qwen.yaml"


@pytest.fixture(scope="module")
def tiny_qwen2_chat_dir(tmp_path_factory):
    """configs/tiny_qwen2.yaml's Qwen2 with the Qwen tokenizer format (ChatML template) and room for GSM8K
    prompts: what the recipe's QWEN_MODEL_PATH points at, in miniature."""
    from chatlearn.models.hf.tiny import ensure_tiny_model
    from tests.conftest import REPO

    with open(f"{REPO}/configs/tiny_qwen2.yaml") as f:
        spec = yaml.safe_load(f)["tiny_model"]
    spec.update(tokenizer="family", max_position_embeddings=1024)
    return str(ensure_tiny_model(tmp_path_factory.mktemp("recipe") / "qwen2-chat", spec))


def test_the_gsm8k_recipe_resolves_its_model_from_the_environment(tiny_qwen2_chat_dir, monkeypatch):
    from chatlearn.config.engine_checks import EngineChecks
    from chatlearn.data.preflight import check_model_files

    monkeypatch.setenv("QWEN_MODEL_PATH", tiny_qwen2_chat_dir)
    cfg = load_config(RECIPE, [], [EngineChecks(None)])
    assert cfg.runtime.engine == "grpo" and cfg.runtime.sample_per_episode == 512
    for name in ("policy", "reference", "ppo_policy"):
        model = cfg.models[name]
        assert model.args_dict["model_path"] == tiny_qwen2_chat_dir and model.args_dict["bf16"] is True
        assert model.num_gpu == 1
    trainer = cfg.models["ppo_policy"].args_dict
    assert (trainer["lr"], trainer["kl_coef"], trainer["kl_estimator"]) == (1e-6, 0.001, "k3")
    assert cfg.models["reward"].args_dict["reward_fn"] == "chatlearn.tasks.math_verify:math_reward"
    assert cfg.runtime.data_path.endswith("configs/data/gsm8k_sample.jsonl")
    check_model_files(cfg, {"policy": PolicyInference("policy")})


@pytest.mark.integration
def test_the_gsm8k_recipe_trains_a_tiny_qwen2_on_cpu(prefect_api, ray_session, tiny_model_dir, tiny_qwen2_chat_dir,
                                                     tmp_path, monkeypatch):
    """The recipe as shipped (bf16, the continuous engine, chat-rendered GSM8K prompts, the math verifier), with
    the GPUs and sizes scaled down: two episodes of 16 samples (2 prompts x 8 responses) of up to 32 tokens."""
    gpu_models = ("policy", "reference", "ppo_policy")
    args = [RECIPE, "runtime.exp_name=recipe", "runtime.num_episode=2", "runtime.sample_per_episode=16",
            "runtime.generation_batch_size=16", "runtime.train_micro_batch_size=8",
            "runtime.train_global_batch_size=8", "runtime.save_episode_interval=2", "runtime.eval_episode_interval=0",
            "runtime.enable_eval_before_training=false", "models.policy.args_dict.max_new_tokens=32",
            "models.reward.num_cpu=1", "models.reward.cpu_per_process=1",
            *(f"models.{m}.{k}" for m in gpu_models for k in ("num_gpu=0", "gpu_per_process=0", "num_cpu=1",
                                                                 "cpu_per_process=1"))]
    start = time.monotonic()
    train_here(args, tmp_path, tiny_model_dir, monkeypatch, QWEN_MODEL_PATH=tiny_qwen2_chat_dir)
    print(f"recipe: {time.monotonic() - start:.1f} s")
    run = tmp_path / "recipe"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows), rows[0].keys()
    final = AutoModelForCausalLM.from_pretrained(run / "final" / "policy")
    assert type(final).__name__ == "Qwen2ForCausalLM"
    assert AutoTokenizer.from_pretrained(run / "final" / "policy").chat_template  # the export keeps the template
