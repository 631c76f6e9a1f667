"""What an engine needs of a config, and the rule that no knob silently does nothing."""

import os
import warnings

import pytest

from chatlearn.config import ConfigError, ConfigWarning, EngineChecks, load_config
from chatlearn.config.support import _CLASSES, FIELDS
from chatlearn.models.hf.policy import PolicyArgs
from tests.conftest import REPO

DEFAULT = os.path.join(REPO, "configs", "default.yaml")


def check(*overrides):
    """Problems and warnings of the default config with `overrides`, with the rlhf engine's checks."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load_config(DEFAULT, overrides, [EngineChecks()])
            problems = []
        except ConfigError as exc:
            problems = exc.problems
    return problems, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def other_value(kind, name):
    """A value that is not the field's default and passes the config's own checks."""
    special = {"platform": "DLC", "param_sync_comm_type": "p2p", "cpu_schedule_strategy": "PACK",
               "colocation": "['policy,reference']", "profiler_dir": "prof", "param_sync_max_workers": 2,
               "min_prompt_length": 8, "partial_rollout_manager_config": "{max_rollout_round: 2}"}
    if name in special:
        return special[name]
    field = _CLASSES[kind].model_fields[name]
    default = field.default_factory() if field.default_factory else field.default
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, int):
        return default + 1
    raise AssertionError(f"no test value for {kind}.{name}")


def override(kind, name, value):
    prefix = {"runtime_env": "runtime_env", "runtime": "runtime", "models.X": "models.ppo_policy",
              "models.X.lora": "models.ppo_policy.lora", "models.X.batch_generation": "models.policy.batch_generation"}
    return f"{prefix[kind]}.{name}={value}"


def path(kind, name):
    return override(kind, name, "").split("=")[0]


def test_every_seed_field_has_a_status():
    for kind, cls in _CLASSES.items():
        declared = set(cls.model_fields)
        assert set(FIELDS[kind]) == declared, kind


def fields_with(status):
    return [(kind, name) for kind, fields in FIELDS.items() for name, s in fields.items() if s.status == status]


# the fields refused now (partial rollouts, not built yet); with none left, the refusal is checked on a field
# marked refused for the test
REFUSED = fields_with("refused") or [("models.X.lora", "lora_dim")]


@pytest.mark.parametrize("kind,name", REFUSED)
def test_a_value_that_would_change_results_is_refused(kind, name, monkeypatch):
    from chatlearn.config.support import Support

    if FIELDS[kind][name].status != "refused":
        monkeypatch.setitem(FIELDS[kind], name, Support("refused", "marked refused by the test"))
    problems, _ = check(override(kind, name, other_value(kind, name)))
    assert len(problems) == 1 and problems[0].startswith(f"{path(kind, name)}: "), problems
    assert "is not supported yet" in problems[0]


@pytest.mark.parametrize("kind,name", fields_with("warned"))
def test_a_value_that_only_tunes_speed_warns_once(kind, name):
    problems, warned = check(override(kind, name, other_value(kind, name)))
    assert problems == []
    assert [w for w in warned if w.startswith(path(kind, name) + "=")] == warned and len(warned) == 1, warned
    assert "has no effect here" in warned[0]


def test_the_default_config_is_clean():
    assert check() == ([], [])


def test_offload_flags_act_on_colocated_models_and_warn_on_others():
    assert check("models.ppo_policy.free_memory=true") == ([], [])  # the default colocates all six
    problems, warned = check("models.ppo_policy.free_memory=true", "models.value.offload_weights=true",
                             "runtime.colocation=['policy,reference,reward,ppo_policy']")
    assert problems == []
    assert [w.split("=")[0] for w in warned] == ["models.value.offload_weights"]  # the switch, not its effects


def test_vllm_top_k_minus_one_means_off():
    assert check("models.policy.args_dict.top_k=-1") == ([], [])
    assert PolicyArgs(top_k=-1).top_k == 0
    assert check("models.policy.args_dict.top_k=-2")[0] == [
        "models.policy.args_dict.top_k: Input should be greater than or equal to -1"]


def test_sync_frequency_minus_one_is_fine_where_no_weights_arrive():
    assert check("models.reference.sync_frequency=-1") == ([], [])
    assert check("models.policy.sync_frequency=-1")[0] == [
        "models.policy.sync_frequency: must be >= 0 for a model that receives weights (0: never sync), got -1"]


def test_engine_models_and_data():
    problems, _ = check("runtime.engine=ppo")
    assert problems == ["runtime.engine: unknown engine 'ppo'; known: ['dpo', 'eval', 'grpo', 'grpo_math', "
                        "'online_dpo', 'rlhf'], or an Engine subclass as 'package.module:Class' (or 'file.py:Class' "
                        "next to the config)"]
    problems, _ = check("models.critic.num_cpu=1", "runtime.data_path=null")
    assert problems == [
        "models.critic: the rlhf engine does not use a model named 'critic' (it uses policy, reference, reward, "
        "value, ppo_policy, ppo_value); remove it or rename it",
        "runtime.data_path: the rlhf engine needs a prompt file (JSONL or JSON)",
    ]
    # the eval engine leaves a training config's other models alone, and needs the eval set
    load_config(DEFAULT, [], [EngineChecks("eval")])
    with pytest.raises(ConfigError, match="runtime.eval_data_path: evaluation needs an eval set"):
        load_config(DEFAULT, ["runtime.eval_data_path=null"], [EngineChecks("eval")])


def test_relay_needs_its_hook_and_hooks_must_import():
    problems, _ = check("runtime.max_relay_episode=-3", "runtime.eval_post_process_fn=chatlearn.tasks.max_digit:no")
    assert [p.split(":")[0] for p in problems] == ["runtime.relay_sample_fn", "runtime.eval_post_process_fn"]


def test_multi_process_replicas_need_a_module_that_takes_them():
    problems, _ = check("models.reference.num_cpu=2", "models.reference.cpu_per_process=1",
                        "models.reference.num_replica=1")
    assert problems == [
        "models.reference.num_cpu: 2 with cpu_per_process=1 gives 2 processes per replica (1 replica(s)), but an "
        "inference replica of ReferenceModel splits only by tensor parallel (tensor_model_parallel_size=1): set "
        "tensor_model_parallel_size to 2, or cpu_per_process so that a replica is one process (more replicas are "
        "data parallel)"]
    assert check("models.reference.num_cpu=2", "models.reference.tensor_model_parallel_size=2")[0] == []
    two = ("models.ppo_policy.num_cpu=2", "models.ppo_policy.cpu_per_process=1")
    assert check(*two, "models.ppo_policy.zero_size=2")[0] == []
    assert check(*two)[0] == []  # data parallel
    assert check(*two, "models.ppo_policy.pipeline_model_parallel_size=2")[0] == []
    assert check("models.ppo_value.num_cpu=2", "models.ppo_value.cpu_per_process=1",
                 "models.ppo_value.pipeline_model_parallel_size=2")[0] == [
        "models.ppo_value.pipeline_model_parallel_size: 2: PPOValueTrainer does not run pipeline stages yet (the "
        "policy, reference and PPO/GRPO policy trainers do; use tensor_model_parallel_size or zero_size)"]
    assert check("models.ppo_policy.num_cpu=4", "models.ppo_policy.cpu_per_process=1",
                 "models.ppo_policy.pipeline_model_parallel_size=2")[0] == [
        "models.ppo_policy.num_cpu: 4 with cpu_per_process=1 gives 4 processes per replica (1 replica(s)), but "
        "pipeline parallel next to tensor/data parallel or ZeRO is not supported yet: a pipeline replica has "
        "pipeline_model_parallel_size = 2 processes"]


def check_config(name, *overrides):
    """Problems of a shipped engine config with `overrides`, with its engine's checks."""
    try:
        load_config(os.path.join(REPO, "configs", f"{name}.yaml"), overrides, [EngineChecks()])
        return []
    except ConfigError as exc:
        return exc.problems


@pytest.mark.parametrize("name", ["grpo", "dpo", "online_dpo"])
def test_the_shipped_engine_configs_pass(name):
    assert check_config(name) == []


def test_prompt_groups_must_be_whole():
    n = "models.policy.args_dict.num_inference_per_prompt"
    assert check_config("grpo", f"{n}=1") == [
        f"{n}: the grpo engine compares several responses to the same prompt; set it to 2 or more (ChatLearn's "
        "GRPO examples use 8 to 32), got 1"]
    assert check_config("grpo", f"{n}=6") == [
        f"runtime.sample_per_episode: 128 is not a multiple of {n} (6); an episode must hold whole prompt groups",
        f"runtime.generation_batch_size: 64 is not a multiple of {n} (6); a generation batch must hold whole "
        "prompt groups"]
    assert check_config("online_dpo", "runtime.train_micro_batch_size=6", "runtime.train_global_batch_size=6") == [
        "runtime.train_micro_batch_size: online DPO builds its pairs inside each prompt's group, so a micro-batch "
        f"must hold whole groups: it must be a multiple of {n} (4) and divide sample_per_episode (128), got 6"]


def test_grpo_reference_is_optional_only_without_kl():
    import yaml

    no_ref = ["models.ppo_policy.args_dict.kl_coef=0.0"]
    raw = yaml.safe_load(open(os.path.join(REPO, "configs", "grpo.yaml")))
    del raw["models"]["reference"]
    raw["runtime"]["colocation"] = ["policy,reward,ppo_policy"]
    raw["runtime"]["data_path"] = os.path.join(REPO, "configs", "data", "max_digit_train.jsonl")
    raw["runtime"]["eval_data_path"] = os.path.join(REPO, "configs", "data", "max_digit_eval.jsonl")
    for m in raw["models"].values():
        if m.get("model_config_file"):
            m["model_config_file"] = os.path.join(REPO, "configs", m["model_config_file"])
    try:
        load_config(raw, [], [EngineChecks()])
        problems = []
    except ConfigError as exc:
        problems = exc.problems
    assert problems == ["models.ppo_policy.args_dict.kl_coef: 0.01 needs a reference model (models.reference); "
                        "add one or set kl_coef to 0"]
    load_config(raw, no_ref, [EngineChecks()])  # no KL term: no reference needed
    # nor a KL penalty in the reward (REINFORCE++'s)
    rpp = [*no_ref, "models.reward.args_dict.advantage_estimator=reinforce_pp",
           "models.ppo_policy.args_dict.whiten_advantages=true"]
    load_config(raw, rpp, [EngineChecks()])
    with pytest.raises(ConfigError) as err:
        load_config(raw, [*rpp, "models.reward.args_dict.kl_coef=0.02"], [EngineChecks()])
    assert err.value.problems == ["models.reward.args_dict.kl_coef: 0.02 penalises the KL to the reference; add "
                                  "models.reference or set kl_coef to 0"]


def test_old_logprobs_from_generation_need_the_trainers_weights():
    assert check_config("grpo", "models.policy.sync_frequency=2") == [
        "models.policy.sync_frequency: 2 leaves the policy behind the trainer between syncs, but old_logprobs: "
        "generation takes the sampler's log-probs as the trainer's; set old_logprobs: trainer for the trainer's "
        "own forward pass"]
    assert check_config("grpo", "models.policy.sync_frequency=2",
                        "models.ppo_policy.args_dict.old_logprobs=trainer") == []


def test_current_old_logprobs_need_one_optimizer_step_per_episode():
    # configs/grpo.yaml: 128 samples an episode, 64 a step
    assert check_config("grpo", "models.ppo_policy.args_dict.old_logprobs=current") == [
        "models.ppo_policy.args_dict.old_logprobs: current takes the training forward's own log-probs as the old "
        "ones, exact only for one optimizer step per episode, but runtime.sample_per_episode 128 over "
        "runtime.train_global_batch_size 64 times runtime.num_training_epoch 1 makes 2; use generation or trainer"]
    assert check_config("grpo", "models.ppo_policy.args_dict.old_logprobs=current", "models.policy.sync_frequency=2",
                        "runtime.train_global_batch_size=128", "models.policy.args_dict.temperature=0.7") == []
    # a batch size the runtime check refuses is named there, once
    assert check_config("grpo", "models.ppo_policy.args_dict.old_logprobs=current",
                        "runtime.train_global_batch_size=0") == ["runtime.train_global_batch_size: must be > 0, got 0"]


def test_reward_settings_the_estimator_does_not_read_are_refused():
    assert check_config("grpo", "models.reward.args_dict.kl_coef=0.05") == [
        "models.reward.args_dict.kl_coef: the advantage estimator 'grpo' does not use it (it reads none of "
        "['kl_coef', 'kl_estimator', 'gamma', 'lam']) (the KL loss term is models.ppo_policy.args_dict.kl_coef); "
        "remove it"]
    assert len(check_config("online_dpo", "models.reward.args_dict.lam=0.9")) == 1
    # REINFORCE++ reads the KL penalty and gamma, not GAE's lambda; it needs the trainer's global whitening
    rpp = ("models.reward.args_dict.advantage_estimator=reinforce_pp", "models.reward.args_dict.gamma=0.99")
    assert check_config("grpo", *rpp, "models.reward.args_dict.lam=0.9") == [
        "models.reward.args_dict.lam: the advantage estimator 'reinforce_pp' does not use it (it reads ['kl_coef', "
        "'kl_estimator', 'gamma']); remove it",
        "models.ppo_policy.args_dict.whiten_advantages: the advantage estimator 'reinforce_pp' is whitened over each "
        "global batch by the trainer; set it to true"]
    assert check_config("grpo", *rpp, "models.ppo_policy.args_dict.whiten_advantages=true",
                        "models.reward.args_dict.kl_coef=0.01", "models.reward.args_dict.kl_estimator=k3") == []


def test_the_advantage_estimator_is_the_engines_and_an_unknown_one_is_refused():
    assert check("models.reward.args_dict.advantage_estimator=vtrace")[0] == [
        "models.reward.args_dict.advantage_estimator: unknown advantage estimator 'vtrace' (known: dr_grpo, gae, grpo, "
        "reinforce_pp, reinforce_pp_baseline, rloo)"]
    # the engine's own, named: accepted; another engine's whose inputs the models make: accepted too
    assert check_config("grpo", "models.reward.args_dict.advantage_estimator=grpo") == []
    assert check("models.reward.args_dict.advantage_estimator=gae")[0] == []
    # GAE reads the critic's values: refused where the engine has no value model
    assert check_config("grpo", "models.reward.args_dict.advantage_estimator=gae") == [
        "models.reward.args_dict.advantage_estimator: 'gae' reads ['values'], which no model of the grpo engine "
        "makes (the grpo engine runs 'grpo')"]
    # the group estimator reads prompt groups: one response per prompt (the default's) makes none; its
    # per-sequence advantages are not the PPO trainer's; and the default's GAE settings (its KL penalty, gamma,
    # lam) would do nothing: each is named
    problems = check("models.reward.args_dict.advantage_estimator=grpo")[0]
    assert problems[0].startswith("models.reward.args_dict.advantage_estimator: 'grpo' makes advantages per "
                                  "sequence [B], but models.ppo_policy (PPOPolicyTrainer) takes token advantages only")
    assert problems[-1] == (
        "models.reward.args_dict.advantage_estimator: 'grpo' reads ['group_id'], which no model of the rlhf engine "
        "makes (the rlhf engine runs 'gae')")
    assert [p.split(":")[0] for p in problems[1:-1]] == [f"models.reward.args_dict.{k}" for k in ("kl_coef", "gamma",
                                                                                                   "lam")]


def test_an_engine_built_in_code_under_another_runtime_engine_runs_its_own_estimator(monkeypatch):
    # the reward takes its default from runtime.engine: the prepared run of a grpo engine built in code (or named
    # by the flow's engine argument) under runtime.engine rlhf records grpo, so its reward runs 'grpo', not GAE
    import chatlearn.runtime.prepared as prepared
    from chatlearn.runtime.engines import resolve_engine

    monkeypatch.setattr(prepared, "preflight", lambda cfg, eng: None)  # no data or model files needed here
    cfg = load_config(os.path.join(REPO, "configs", "grpo.yaml"), ["runtime.engine=rlhf"], [EngineChecks("grpo")])
    run = prepared.prepare_run(cfg, engine="grpo")
    assert (run.engine.name, run.cfg.runtime.engine, cfg.runtime.engine) == ("grpo", "grpo", "rlhf")
    reward = run.engine.modules["reward"]
    reward.bind(run.cfg.models["reward"], run.cfg.runtime, 0, 0)
    assert reward.advantage_estimator() == "grpo"
    assert resolve_engine(cfg).name == "rlhf"  # the config alone still names rlhf
