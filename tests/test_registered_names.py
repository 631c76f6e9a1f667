"""Every name a config gives that picks a registered piece is checked against its registry before anything
starts: a typo is one line naming the field and the nearest name, a piece of the wrong family one line saying
why. (The rollout engine's: tests/test_rollout_engines.py; a tracker flag's: tests/test_trackers.py.)"""

import pytest

from chatlearn.algorithms import masked_mean
from chatlearn.algorithms.registry import (
    ADVANTAGE_ESTIMATOR_INPUTS,
    ADVANTAGE_ESTIMATOR_SETTINGS,
    ADVANTAGE_ESTIMATOR_SHAPE,
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSS_FAMILY,
    POLICY_LOSSES,
    register_advantage_estimator,
    register_policy_loss,
)
from chatlearn.config import ConfigError, EngineChecks, load_config
from tests.conftest import REPO

DEFAULT, GRPO = f"{REPO}/configs/default.yaml", f"{REPO}/configs/grpo.yaml"
AGENT = f"{REPO}/configs/agent_higher_lower.yaml"


def problems(config: str, *overrides: str) -> list[str]:
    try:
        load_config(config, list(overrides), [EngineChecks()])
    except ConfigError as exc:
        return exc.problems
    return []


@pytest.mark.parametrize(("config", "override", "expected"), [
    (DEFAULT, "models.ppo_policy.args_dict.policy_loss=ppo_clp",
     "models.ppo_policy.args_dict.policy_loss: unknown policy loss 'ppo_clp'; did you mean ppo_clip? (known: cispo, "
     "grpo, gspo, ppo_clip)"),
    (GRPO, "models.ppo_policy.args_dict.policy_loss=gpso",
     "models.ppo_policy.args_dict.policy_loss: unknown policy loss 'gpso'; did you mean gspo? (known: cispo, grpo, "
     "gspo, ppo_clip)"),
    (DEFAULT, "models.ppo_value.args_dict.value_loss=ppo_clipp",
     "models.ppo_value.args_dict.value_loss: unknown value loss 'ppo_clipp'; did you mean ppo_clip? (known: "
     "ppo_clip)"),
    (DEFAULT, "models.reward.args_dict.advantage_estimator=reinforce_p",
     "models.reward.args_dict.advantage_estimator: unknown advantage estimator 'reinforce_p'; did you mean "
     "reinforce_pp? (known: dr_grpo, gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo)"),
    (DEFAULT, "models.reward.args_dict.kl_estimator=kk3",
     "models.reward.args_dict.kl_estimator: unknown KL estimator 'kk3'; did you mean k3? (known: k1, k2, k3)"),
    (GRPO, "models.ppo_policy.args_dict.kl_estimator=k4",
     "models.ppo_policy.args_dict.kl_estimator: unknown KL estimator 'k4' (known: k1, k2, k3)"),
    (GRPO, "models.ppo_policy.args_dict.loss_agg_mode=token_mean",
     "models.ppo_policy.args_dict.loss_agg_mode: unknown loss aggregation mode 'token_mean'; did you mean "
     "token-mean? (known: seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean)"),
    (DEFAULT, "models.policy.args_dict.dtype=bfloat",
     "models.policy.args_dict.dtype: 'bfloat' is not a torch floating-point dtype; did you mean bfloat16? (one of "
     "bfloat16, float16, float32, float64)"),
    (GRPO, "models.ppo_policy.args_dict.old_logprobs=trainr",  # a choice of the schema's own (a Literal)
     "models.ppo_policy.args_dict.old_logprobs: Input should be 'generation', 'trainer' or 'current'; did you mean "
     "trainer?"),
    (AGENT, "runtime.agent.env=chatlearn.tasks.higher_lower:HigherLowr",
     "runtime.agent.env: 'chatlearn.tasks.higher_lower:HigherLowr': 'chatlearn.tasks.higher_lower' has no attribute "
     "'HigherLowr'; did you mean HigherLower?"),
    (AGENT, "runtime.agent.env_args={max_gueses: 3}",
     "runtime.agent.env_args.max_gueses: not an argument of HigherLower; did you mean max_guesses? (it takes "
     "['max_guesses'])"),
])
def test_a_misspelt_name_is_one_line_naming_the_field_and_the_nearest_name(config, override, expected):
    assert problems(config, override) == [expected]


def test_an_unknown_rollout_correction_names_the_nearest():
    found = problems(GRPO, "models.ppo_policy.args_dict.rollout_correction=tis_tokn",
                     "models.ppo_policy.args_dict.old_logprobs=trainer")
    assert found == ["models.ppo_policy.args_dict.rollout_correction: unknown rollout correction 'tis_tokn'; did you "
                     "mean tis_token? (known: decoupled, mis_seq, mis_token, none, tis_seq, tis_token)"]


def test_a_tool_environment_checks_its_tools_against_the_tool_registry():
    env = ("runtime.agent.env=chatlearn.envs.tool_env:ToolEnvironment",)
    assert problems(AGENT, *env, "runtime.agent.env_args={tools: [calculater]}") == [
        "runtime.agent.env_args.tools: unknown tool 'calculater'; did you mean calculator? (known: calculator, "
        "python)"]
    assert problems(AGENT, *env, "runtime.agent.env_args={tools: [python]}") == []
    assert problems(AGENT, "runtime.agent.env=chatlearn.envs.gym:GymTextEnv") == [  # the config's max_guesses: 4
        "runtime.agent.env_args.max_guesses: not an argument of GymTextEnv (it takes ['factory', 'kwargs'])",
        "runtime.agent.env_args: GymTextEnv needs ['factory']"]
    assert problems(AGENT, "runtime.agent.env=chatlearn.envs.gym:GymTextEnv",
                    "runtime.agent.env_args={factory: 'chatlearn.tasks.higher_lower:HigherLowr'}") == [
        "runtime.agent.env_args.factory: 'chatlearn.tasks.higher_lower:HigherLowr': 'chatlearn.tasks.higher_lower' "
        "has no attribute 'HigherLowr'; did you mean HigherLower?"]


def test_a_policy_loss_of_another_family_is_refused_naming_why():
    assert problems(DEFAULT, "models.ppo_policy.args_dict.policy_loss=gspo") == [
        "models.ppo_policy.args_dict.policy_loss: 'gspo' is a grpo-family policy loss (called with the GRPO "
        "trainer's clip ratios (pos/neg/diff/final), loss_agg_mode with the global batch's units, and the rollout "
        "correction's token weights), but the PPO policy trainer calls ppo-family losses: ppo_clip"]
    assert problems(GRPO, "models.ppo_policy.args_dict.policy_loss=ppo_clip") == [
        "models.ppo_policy.args_dict.policy_loss: 'ppo_clip' is a ppo-family policy loss (called with the PPO "
        "trainer's cliprange and clip_ratio_c (verl's dual clip)), but the GRPO policy trainer calls grpo-family "
        "losses: cispo, grpo, gspo"]
    assert problems(GRPO, "models.ppo_policy.args_dict.policy_loss=cispo") == []


def test_an_aggregation_of_a_trainers_own_units_is_not_a_policy_loss_mode():
    assert problems(GRPO, "models.ppo_policy.args_dict.loss_agg_mode=sequence-mean") == [
        "models.ppo_policy.args_dict.loss_agg_mode: 'sequence-mean' counts a trainer's own units, not a per-token "
        "policy loss's; one of token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"]


def test_per_sequence_advantages_are_refused_for_the_ppo_trainer():
    """GRPO-family estimators make one advantage per response; the PPO trainer's loss and whitening are per token
    (its first step would fail with an IndexError). The GRPO trainer takes both."""
    cfg = load_config(DEFAULT, ["models.policy.args_dict.num_inference_per_prompt=2"])
    reward = cfg.models["reward"].args_dict
    for key in ("kl_coef", "gamma", "lam"):  # GAE's settings, which the group estimators do not read
        reward.pop(key)
    reward["advantage_estimator"] = "rloo"
    assert EngineChecks()(cfg) == [
        "models.reward.args_dict.advantage_estimator: 'rloo' makes advantages per sequence [B], but models.ppo_policy "
        "(PPOPolicyTrainer) takes token advantages only; use one of ['gae', 'reinforce_pp', 'reinforce_pp_baseline']"]
    reward.update(advantage_estimator="reinforce_pp_baseline", gamma=1.0)
    assert EngineChecks()(cfg) == []
    assert problems(GRPO, "models.reward.args_dict.advantage_estimator=rloo") == []


def test_a_plugged_in_loss_and_estimator_are_checked_by_what_they_declare():
    """Nothing in the checks lists names: a loss registered in the grpo family is accepted by the GRPO trainer and
    refused by the PPO one; an estimator's declared shape decides which trainers take it."""
    def my_loss(logprobs, old_logprobs, advantages, mask, **_):
        return masked_mean(-advantages * logprobs, mask), {}

    def my_estimator(batch, args):
        return {"advantages": batch["scores"]}

    try:
        register_policy_loss("test_names_loss", family="grpo")(my_loss)
        register_advantage_estimator("test_names_adv", shape="sequence", inputs=("group_id",))(my_estimator)
        assert problems(GRPO, "models.ppo_policy.args_dict.policy_loss=test_names_loss",
                        "models.reward.args_dict.advantage_estimator=test_names_adv") == []
        assert problems(DEFAULT, "models.ppo_policy.args_dict.policy_loss=test_names_loss")[0].startswith(
            "models.ppo_policy.args_dict.policy_loss: 'test_names_loss' is a grpo-family policy loss")
        with pytest.raises(TypeError, match="shape"):
            register_advantage_estimator("test_names_no_shape")  # a new estimator says what it makes
        with pytest.raises(ValueError, match="unknown shape 'group'"):
            register_advantage_estimator("test_names_bad", shape="group")
    finally:
        for registry in (POLICY_LOSSES, POLICY_LOSS_FAMILY):
            registry.pop("test_names_loss", None)
        for registry in (ADVANTAGE_ESTIMATORS, ADVANTAGE_ESTIMATOR_SHAPE, ADVANTAGE_ESTIMATOR_INPUTS,
                         ADVANTAGE_ESTIMATOR_SETTINGS):
            registry.pop("test_names_adv", None)
