"""GRPO, DPO and online DPO pieces in-process (no Ray, no Prefect): prompt groups, group advantages, the
rule reward's guard rails, pair building, pair batches, old log-probs, the GRPO step's token normalisation,
and the LoRA trainer's merged sync."""

import copy
import math
import os
import time

import pytest
import torch

from chatlearn.algorithms.grpo import group_advantages, group_advantages_by_id
from chatlearn.data.batch import collate_samples, split_batch
from chatlearn.data.sampler import episode_generation_batches, episode_prompt_batches
from chatlearn.models.hf.dpo import DPOPolicyTrainer, PairReference, pairs_in_groups
from chatlearn.models.hf.grpo_trainer import GRPOPolicyTrainer
from chatlearn.models.hf.policy import PolicyInference
from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer
from chatlearn.models.hf.reward import RuleReward
from chatlearn.models.hf.trainer import CausalLMTrainer
from chatlearn.models.rule import RewardError, score_samples
from chatlearn.tasks.max_digit import make_pairs, make_records, max_digit_reward
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig


def bound(cls, name, args, trainable=False, **model_fields):
    mod = cls(name)
    mod.bind(ModelConfig(num_cpu=1, trainable=trainable, args_dict=args, **model_fields), RuntimeConfig(), 0, seed=7)
    mod.setup()
    return mod


# -- prompt groups ---------------------------------------------------------------------------------------------

def test_one_response_per_prompt_is_the_old_sampler():
    old = episode_prompt_batches(100, 37, 64, 16, 3, shuffle_seed=5)
    new = episode_generation_batches(100, 37, 64, 16, 3, shuffle_seed=5)
    assert [(r, idx) for r, idx, _ in new] == old
    ids = [i for _, _, sid in new for i in sid]
    assert ids == list(range(37, 37 + 64))


def test_groups_stay_whole_inside_batches_and_replicas():
    n = 4
    batches = episode_generation_batches(50, 8, 64, 16, 3, group_size=n)  # 16 prompts, 4 per batch
    assert sum(len(idx) for _, idx, _ in batches) == 64
    seen_groups = set()
    for _replica, idx, ids in batches:
        assert len(idx) % n == 0
        groups = [ids[k : k + n] for k in range(0, len(ids), n)]
        for k, g in enumerate(groups):
            gid = {s // n for s in g}
            assert len(gid) == 1  # one group id per run of n responses ...
            assert len(set(idx[k * n : (k + 1) * n])) == 1  # ... to one prompt
            assert not gid & seen_groups  # and a group is never split across batches or replicas
            seen_groups |= gid
    # the prompt stream advances by sample_per_episode / n prompts: episode 2 starts where episode 1 stopped
    first = [idx[0] for _, idx, _ in batches]
    assert first[0] == 8 // n
    two = episode_generation_batches(50, 8, 128, 16, 3, group_size=n)
    again = episode_generation_batches(50, 8 + 64, 64, 16, 3, group_size=n)
    assert [i for _, idx, _ in two for i in idx][64:] == [i for _, idx, _ in again for i in idx]


def test_group_advantages_by_id_do_not_depend_on_the_order():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])  # a group of 4 with ties, an all-equal group
    ids = [0, 0, 0, 0, 1, 1, 1, 1]
    expected = group_advantages(r, 4)
    assert torch.equal(group_advantages_by_id(r, ids), expected)
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = group_advantages_by_id(r[perm], [ids[p] for p in perm])
    assert torch.equal(shuffled, expected[perm])
    assert torch.equal(expected[4:], torch.zeros(4))  # all equal: no signal
    # (r - mean) / (population std + eps) for the first group: mean 0.5, std 0.5
    assert torch.allclose(expected[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.5 + 1e-5))
    with pytest.raises(ValueError, match="group 1 has 2 responses"):
        group_advantages_by_id(torch.zeros(6), [0, 0, 0, 0, 1, 1])


# -- the rule reward's guard rails ----------------------------------------------------------------------------

def _raises(sample):
    raise KeyError("answer")


def _slow(sample):
    time.sleep(30)
    return 1.0


SAMPLES = [{"sample_id": 11, "prompt": "max 1 2 ?", "response": "2", "answer": "2"},
           {"sample_id": 12, "prompt": "max 7 3 ?", "response": "1", "answer": "7"}]


def test_rule_reward_errors_name_the_sample():
    assert score_samples(max_digit_reward, SAMPLES, 5, "reward") == [1.0, pytest.approx(0.5 * (1 - 6 / 9))]
    expected = r"reward raised KeyError: 'answer' for sample_id 11 \(prompt \"max 1 2 \?\"\)"
    with pytest.raises(RewardError, match=expected):
        score_samples(_raises, SAMPLES, 5, "reward")
    for bad in (float("nan"), "1.0", None, True):
        with pytest.raises(RewardError, match=r"returned .* for sample_id 11 .*expected a finite number"):
            score_samples(lambda s, bad=bad: bad, SAMPLES, 5, "reward")
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"took longer than timeout_s=0.5s for sample_id 11"):
        score_samples(_slow, SAMPLES, 0.5, "reward")
    assert time.perf_counter() - t0 < 5


def test_fanned_out_scores_are_used_as_given():
    reward = bound(RuleReward, "reward", {"reward_fn": "chatlearn.tasks.max_digit:max_digit_reward"})
    data = {"prompt": ["a", "b"], "response": ["x", "y"], "answer": ["1", "2"], "rewards/reward": [0.25, 0.75]}
    assert reward.score(data).tolist() == [0.25, 0.75]
    data["scores"] = [0.5, 0.5]  # another call's scores are not this reward's
    data.pop("rewards/reward")
    assert reward.score(data).tolist() == [0.0, 0.0]


def test_a_reward_adds_the_other_rewards_scores_by_weight_and_keeps_each():
    """GRPOMath / a custom engine: the answer reward's inputs hold the format reward's scores (its score_step
    output); it trains on 1.0 * its own + 0.5 * format, made into group advantages, each reward kept by name."""
    fn = "chatlearn.tasks.max_digit:max_digit_reward"
    answer = RuleReward("answer")
    answer.bind(ModelConfig(num_cpu=1, args_dict={"reward_fn": fn, "advantage_estimator": "grpo",
                                                  "reward_weights": {"answer": 1.0, "format": 0.5}}),
                RuntimeConfig(engine="grpo_math"), 0, seed=7)
    answer.setup()
    fmt = bound(RuleReward, "format", {"reward_fn": "chatlearn.tasks.max_digit:format_reward"})
    data = {"prompt": ["max 1 9 ?", "max 1 9 ?", "max 3 4 ?", "max 3 4 ?"], "response": ["9", "9x", "1", "4"],
            "answer": ["9", "9", "4", "4"], "group_id": [0, 0, 1, 1]}
    assert fmt.score_step(data)["rewards/format"].tolist() == [1.0, 0.0, 1.0, 1.0]
    out = answer.forward_step({**data, **fmt.score_step(data)}, 0)
    own = [1.0, 1.0, 0.5 * (1 - 3 / 9), 1.0]
    total = [o + 0.5 * f for o, f in zip(own, [1.0, 0.0, 1.0, 1.0], strict=True)]
    assert out["rewards/answer"].tolist() == pytest.approx(own)
    assert out["scores"].tolist() == pytest.approx(total)
    # the group advantages are those of the sum
    expected = group_advantages_by_id(torch.tensor(total), [0, 0, 1, 1])
    assert out["advantages"].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    # alone, a reward is just its own scores: no name added
    assert "rewards/answer" not in answer.forward_step(dict(data), 0)
    assert answer.eval_step({**data, "rewards/format": [1.0, 0.0, 1.0, 1.0]})["scores"].tolist() == \
        pytest.approx(total)


def test_the_examples_filter_step_keeps_the_groups_whose_scores_differ():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "custom_engine.py")
    spec = importlib.util.spec_from_file_location("custom_engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    batch = {"group_id": [0, 0, 1, 1, 2, 2], "scores": torch.tensor([1.0, 1.0, 0.0, 0.5, 0.2, 0.2]),
             "response_ids": torch.arange(12).view(6, 2), "prompt": list("abcdef")}
    kept = module.drop_uniform_groups(batch)
    assert kept["group_id"] == [1, 1] and kept["prompt"] == ["c", "d"]
    assert kept["response_ids"].tolist() == [[4, 5], [6, 7]] and kept["scores"].tolist() == [0.0, 0.5]


# -- pairs -----------------------------------------------------------------------------------------------------

def test_online_pairs_stay_inside_their_group_whatever_the_earlier_groups():
    scores = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 1.0, 0.2])  # group 7: all tied, no pair
    pairs = pairs_in_groups(scores, [7, 7, 7, 7, 9, 9, 9, 9])
    assert pairs == [(4, 5), (4, 7), (6, 5), (6, 7), (7, 5)]  # ChatLearn's offset bug would read group 7


def test_a_pair_batch_splits_and_collates_back(tiny_model_dir):
    ref = bound(PairReference, "reference", {"model_path": tiny_model_dir})
    pairs = make_pairs(5, seed=1)
    pairs[0]["rejected"] = "12"  # responses of different lengths
    batch = ref.forward_step(ref.collate_fn(ref.build_dataset(pairs)), 0)
    samples = split_batch(batch)
    assert samples[0]["rejected_ids"].shape[0] == 3 and samples[1]["rejected_ids"].shape[0] == 2  # + EOS
    assert samples[0]["rejected_ref_logprobs"].shape == samples[0]["rejected_ids"].shape
    back = collate_samples(samples, ref.tokenizer.pad_token_id)
    for key in ("response_ids", "rejected_ids", "rejected_mask", "ref_logprobs", "rejected_ref_logprobs"):
        assert torch.equal(back[key], batch[key]), key
    with pytest.raises(ValueError, match="pair record 1 has no string field 'rejected'"):
        ref.build_dataset([pairs[0], {"prompt": "max 1 ?", "chosen": "1"}])


def test_a_dpo_step_raises_the_chosen_over_the_rejected(tiny_model_dir):
    ref = bound(PairReference, "reference", {"model_path": tiny_model_dir})
    trainer = bound(DPOPolicyTrainer, "ppo_policy", {"model_path": tiny_model_dir, "lr": 1e-3}, trainable=True)
    batch = ref.forward_step(ref.collate_fn(ref.build_dataset(make_pairs(16, seed=2))), 0)
    before = trainer.eval_step(batch)["scores"]
    assert torch.equal(before, torch.zeros(16))  # policy == reference: no margin yet
    stats = [trainer.train_step([batch], i) for i in range(3)]
    assert stats[0]["dpo_loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)
    after = trainer.eval_step(batch)
    assert after["scores"].mean() > 0 and after["preferred"].mean() > 0.5


# -- GRPO trainer ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grpo_batch(tiny_model_dir):
    policy = bound(PolicyInference, "policy", {"model_path": tiny_model_dir, "max_new_tokens": 4})
    records = [r for r in make_records(3, seed=0) for _ in range(4)]
    batch = policy.collate_fn(policy.build_dataset(records))
    batch["sample_id"] = list(range(12))
    batch["group_id"] = [i // 4 for i in range(12)]
    out = policy.forward_step(batch, iteration=1)
    reward = bound(RuleReward, "reward", {"reward_fn": "chatlearn.tasks.max_digit:max_digit_reward",
                                          "advantage_estimator": "grpo"})  # the grpo engine's default
    return {**out, **reward.forward_step(out, 1)}


def test_old_logprobs_from_generation_and_from_the_trainer_agree(tiny_model_dir, grpo_batch):
    trainer = bound(GRPOPolicyTrainer, "ppo_policy", {"model_path": tiny_model_dir, "old_logprobs": "trainer"},
                    trainable=True)
    old = trainer.forward_step(grpo_batch, 1)["old_logprobs"]
    assert old.shape == grpo_batch["logprobs"].shape
    assert torch.allclose(old, grpo_batch["logprobs"], atol=1e-6, rtol=0)  # same weights, same forward


@pytest.mark.parametrize("loss, extra", [
    ("grpo", {}),
    ("gspo", {}),
    ("cispo", {"pos_clip_ratio": 0.28}),
    ("grpo", {"loss_agg_mode": "seq-mean-token-mean", "kl_estimator": "k1"}),
    ("gspo", {"loss_agg_mode": "seq-mean-token-sum", "kl_estimator": "k2"}),
    ("grpo", {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 4, "whiten_advantages": True}),
], ids=["grpo", "gspo", "cispo", "seq-mean-token-mean-k1", "seq-mean-token-sum-k2", "dr-grpo-norm-whitened"])
def test_grpo_step_normalises_by_the_global_batch_tokens(tiny_model_dir, grpo_batch, loss, extra):
    """Micro-batches [0:5] and [5:12] give the same gradient as one batch of 12, for every loss, aggregation
    mode (each unit weighs 1/total of the global batch's), KL estimator and the global-batch whitening."""
    args = {"model_path": tiny_model_dir, "kl_coef": 0.1, "entropy_coef": 0.01, "max_grad_norm": 1e9,
            "policy_loss": loss, **extra}
    samples = split_batch({**grpo_batch, "ref_logprobs": grpo_batch["logprobs"] - 0.1})
    grads = []
    for cut in ([slice(0, 12)], [slice(0, 5), slice(5, 12)]):
        trainer = bound(GRPOPolicyTrainer, "ppo_policy", args, trainable=True)
        trainer.optimizer.step = lambda: None  # keep the weights: compare the accumulated gradients
        stats = trainer.train_step([collate_samples(samples[c], 0) for c in cut], 0)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        assert stats["kl_loss"] > 0 and stats["entropy"] > 0
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-4)


# -- LoRA sync -------------------------------------------------------------------------------------------------

def test_lora_trainer_syncs_merged_weights_into_a_plain_policy(tiny_model_dir, grpo_batch):
    lora = {"enable_lora": True, "lora_dim": 4, "lora_scaling": 2.0,
            "lora_layer": "ColumnParallelLinear,RowParallelLinear"}
    trainer = bound(GRPOPolicyTrainer, "ppo_policy", {"model_path": tiny_model_dir, "lr": 1e-2}, trainable=True,
                    lora=lora)
    # the PPO, GRPO and DPO trainers are siblings: LoRA comes from their causal-LM trainer base
    assert isinstance(trainer, CausalLMTrainer) and not isinstance(trainer, PPOPolicyTrainer)
    adapters = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == \
        {id(p) for n, p in trainer.model.named_parameters() if n in adapters}
    frozen = {n: p.clone() for n, p in trainer.model.named_parameters() if n not in adapters}
    trainer.train_step([{**grpo_batch}], 0)
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    policy = bound(PolicyInference, "policy", {"model_path": tiny_model_dir})
    policy.set_weights(trainer.get_weights())
    merged = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    synced = policy.model.state_dict()
    assert synced.keys() == merged.keys()
    assert all(torch.equal(synced[k], merged[k]) for k in merged)
    info = trainer.info()
    assert info["trainable_params"] == sum(p.numel() for n, p in trainer.model.named_parameters() if n in adapters)
    assert info["total_params"] == sum(p.numel() for p in policy.model.parameters())


def test_a_pair_file_missing_a_response_is_refused_with_file_and_line(tmp_path):
    from chatlearn.data.preflight import record_keys
    from chatlearn.data.prompts import DataError
    from chatlearn.data.records import load_records

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "max 1 ?", "chosen": "1", "rejected": "2"}\n{"prompt": "max 2 ?", "chosen": "2"}\n')
    keys = record_keys(PairReference("reference"), {})
    assert keys == ["prompt", "chosen", "rejected"]
    with pytest.raises(DataError, match=r"pairs.jsonl:2: field 'rejected' must be a string, it is missing"):
        load_records(str(path), keys)
    assert record_keys(PolicyInference("policy"), {"prompt_key": "question"}) == ["question"]


def test_current_old_logprobs_give_the_trainers_gradient_without_its_pass(tiny_model_dir, grpo_batch):
    """`old_logprobs: current` (one optimizer step per episode): the ratio is exactly 1 and the gradient equals
    the one with the trainer's own forward pass as the old log-probs, on the same weights, in two micro-batches."""
    args = {"model_path": tiny_model_dir, "kl_coef": 0.1, "entropy_coef": 0.01, "max_grad_norm": 1e9}
    grads, stats = [], []
    for mode in ("trainer", "current"):
        trainer = bound(GRPOPolicyTrainer, "ppo_policy", {**args, "old_logprobs": mode}, trainable=True)
        batch = {**grpo_batch, "ref_logprobs": grpo_batch["logprobs"] - 0.1}
        if mode == "trainer":
            batch.update(trainer.forward_step(batch, 1))
        samples = split_batch(batch)
        trainer.optimizer.step = lambda: None  # keep the weights: compare the accumulated gradients
        stats.append(trainer.train_step([collate_samples(samples[c], 0) for c in (slice(0, 5), slice(5, 12))], 0))
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    assert stats[1]["clipfrac"] == 0 and stats[1]["approx_kl"] == 0  # ratio 1: nothing to clip
    assert stats[0]["policy_loss"] == pytest.approx(stats[1]["policy_loss"], abs=1e-6)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-4)


def test_current_old_logprobs_are_the_proximal_ones_of_a_rollout_correction(tiny_model_dir, grpo_batch):
    """One optimizer step per episode: the detached training log-probs are what the trainer's forward pass in the
    score stage gives, so a correction over them (sampler at half the trainer's probability, `tis_token`, cap 3)
    gives that pass's gradient, and the loss reports the ratio 2, none clipped, without the pass."""
    args = {"model_path": tiny_model_dir, "max_grad_norm": 1e9, "rollout_correction": "tis_token",
            "rollout_is_cap": 3.0}
    grads, stats = [], []
    for mode in ("trainer", "current"):
        trainer = bound(GRPOPolicyTrainer, "ppo_policy", {**args, "old_logprobs": mode}, trainable=True)
        batch = {**grpo_batch}
        scored = trainer.forward_step(batch, 1)["old_logprobs"]
        batch["logprobs"] = (scored - math.log(2.0)) * batch["response_mask"]
        if mode == "trainer":
            batch["old_logprobs"] = scored
        samples = split_batch(batch)
        assert (trainer.episode_stats(list(samples)) == {}) == (mode == "current")
        trainer.optimizer.step = lambda: None  # keep the weights: compare the accumulated gradients
        stats.append(trainer.train_step([collate_samples(samples[c], 0) for c in (slice(0, 5), slice(5, 12))], 0))
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    assert stats[1]["rollout_is_ratio_mean"] == pytest.approx(2.0, rel=1e-5)
    assert stats[1]["rollout_is_clipped_frac"] == 0.0 and "rollout_is_ratio_mean" not in stats[0]
    # the sampler's log-probs against the training forward's: ln 2 apart on every token, k3 = 2 - 1 - ln 2
    assert stats[1]["rollout_logprob_diff_mean"] == pytest.approx(math.log(2.0), rel=1e-5)
    assert stats[1]["rollout_kl"] == pytest.approx(1.0 - math.log(2.0), rel=1e-5)
    assert stats[0]["policy_loss"] == pytest.approx(stats[1]["policy_loss"], abs=1e-6)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-4)


def test_a_rollout_correction_weighs_the_gradient_by_proximal_over_behaviour(tiny_model_dir, grpo_batch):
    """Samples whose sampler gave each token half the trainer's probability: with `tis_token` (cap 3) each token's
    ratio is 2, so the gradient is twice the uncorrected one (old log-probs the trainer's in both), and the
    episode's stats say ratio 2 everywhere, none clipped."""
    args = {"model_path": tiny_model_dir, "max_grad_norm": 1e9, "old_logprobs": "trainer"}
    grads = []
    for correction in ("none", "tis_token"):
        trainer = bound(GRPOPolicyTrainer, "ppo_policy", {**args, "rollout_correction": correction,
                                                          "rollout_is_cap": 3.0}, trainable=True)
        batch = {**grpo_batch}
        batch.update(trainer.forward_step(batch, 1))
        batch["logprobs"] = (batch["old_logprobs"] - math.log(2.0)) * batch["response_mask"]
        samples = split_batch(batch)
        if correction != "none":
            stats = trainer.episode_stats(list(samples))
            assert stats == pytest.approx({"rollout_is_ratio_mean": 2.0, "rollout_is_ratio_max": 2.0,
                                           "rollout_is_clipped_frac": 0.0,
                                           "rollout_logprob_diff_mean": math.log(2.0),
                                           "rollout_logprob_diff_max": math.log(2.0),
                                           "rollout_kl": 1.0 - math.log(2.0)}, rel=1e-5)
        else:  # no correction: the mismatch is still measured
            assert set(trainer.episode_stats(list(samples))) == {"rollout_logprob_diff_mean",
                                                                 "rollout_logprob_diff_max", "rollout_kl"}
        trainer.optimizer.step = lambda: None  # keep the weights: compare the accumulated gradients
        trainer.train_step([collate_samples(samples[c], 0) for c in (slice(0, 5), slice(5, 12))], 0)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], 2 * grads[0][n], atol=1e-6, rtol=1e-4)
