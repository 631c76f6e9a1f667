"""DAPO's pieces: overlong reward shaping, dynamic sampling's group filter, and their config checks (the
clip-higher and token-mean loss are GRPO's, tested with the trainer). The run itself: test_engine_runs."""

import os

import pytest
import torch

from chatlearn.config import ConfigError, EngineChecks, load_config
from chatlearn.data.dynamic_sampling import informative_groups, keep_informative
from chatlearn.models.hf.reward import PPOExperienceArgs, overlong_penalty
from tests.conftest import REPO


def test_overlong_penalty_by_hand():
    # limit 10, buffer 4: no penalty up to 6 tokens, then -factor * (len - 6) / 4, -factor at 10
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4, 0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))


def test_a_run_form_with_every_default_spelled_out_passes():
    """A deployment's run form sends every field, defaults included: a default is never "set but unused"."""
    from chatlearn.config import RuntimeConfig
    from chatlearn.models.hf.grpo_trainer import GRPOPolicyArgs

    fields = {k: f.default for k, f in PPOExperienceArgs.model_fields.items() if k != "advantage_estimator"}
    PPOExperienceArgs(**fields)
    GRPOPolicyArgs(policy_loss="cispo", diff_clip_ratio=10.0, final_clip_ratio=3.0, kl_estimator="k3", kl_coef=0)
    assert check(f"runtime.max_sampling_rounds={RuntimeConfig.model_fields['max_sampling_rounds'].default}",
                 "runtime.dynamic_sampling=false", "runtime.stream_data_loader_type=fixed") == []


def test_overlong_settings_are_refused_when_they_would_do_nothing():
    PPOExperienceArgs(overlong_buffer_len=2, max_response_length=8)
    with pytest.raises(ValueError, match="needs max_response_length"):
        PPOExperienceArgs(overlong_buffer_len=2)
    with pytest.raises(ValueError, match="only with overlong_buffer_len"):
        PPOExperienceArgs(max_response_length=8)
    with pytest.raises(ValueError, match="exceeds max_response_length"):
        PPOExperienceArgs(overlong_buffer_len=9, max_response_length=8)


def sample(sid, group, score):
    return {"sample_id": sid, "group_id": group, "scores": torch.tensor(score)}


def test_only_groups_the_reward_tells_apart_are_kept_whole_and_in_stream_order():
    samples = [sample(7, 3, 1.0), sample(6, 3, 0.0),  # group 3: informative, listed out of order
               sample(0, 0, 0.0), sample(1, 0, 0.0),  # group 0: all equal
               sample(2, 1, 0.5), sample(3, 1, 1.0),  # group 1: informative
               sample(4, 2, 1.0), sample(5, 2, 1.0)]  # group 2: all equal
    kept, dropped = informative_groups(samples)
    assert [[s["sample_id"] for s in g] for g in kept] == [[2, 3], [6, 7]] and dropped == 2
    # the first sample_per_episode kept samples, whole groups only
    out, dropped = keep_informative(samples, 3)
    assert [s["sample_id"] for s in out] == [2, 3] and dropped == 2
    assert [s["sample_id"] for s in keep_informative(samples, 4)[0]] == [2, 3, 6, 7]


def check(*overrides):
    try:
        load_config(os.path.join(REPO, "configs", "dapo.yaml"), list(overrides), [EngineChecks()])
        return []
    except ConfigError as exc:
        return exc.problems


def test_the_dapo_config_passes_and_its_checks_name_the_field():
    assert check() == []
    assert check("runtime.stream_data_loader_type=fixed") == [
        "runtime.stream_data_loader_type: 'fixed' trains exactly sample_per_episode samples, but with "
        "dynamic_sampling an episode whose rounds ran out trains the groups it kept; set it to 'dynamic'"]
    assert check("runtime.dynamic_sampling=false", "runtime.stream_data_loader_type=fixed") == []
    assert check("runtime.dynamic_sampling=false", "runtime.max_sampling_rounds=5") == [
        "runtime.max_sampling_rounds: only used with runtime.dynamic_sampling: true; remove it"]
    assert check("runtime.use_partial_rollout=true") == [
        "runtime.dynamic_sampling with runtime.use_partial_rollout is not supported yet; set one of them to false"]
    assert check("models.reward.args_dict.max_response_length=3") == [
        "models.reward.args_dict.max_response_length: 3 is not the policy's max_new_tokens (4), the length the "
        "overlong penalty counts to"]
