"""The advantage estimators, policy losses, loss aggregation modes and KL estimators selectable by name:
hand-computed values, and numbers verl's own code computed on fixed tensors (tests/data/peer_numbers)."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from chatlearn.algorithms import (
    gae_advantages_and_returns,
    get_advantage_estimator,
    get_kl_estimator,
    get_policy_loss,
    whiten_global_batch,
)
from chatlearn.algorithms.aggregation import aggregate_loss
from chatlearn.algorithms.ppo import discounted_returns

PEER = json.loads((Path(__file__).parent / "data" / "peer_numbers" / "verl_core_algos.json").read_text())["cases"]
D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def args(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"kl_coef": None, "kl_estimator": None, "gamma": 1.0, "lam": 0.95, **kw})


def estimate(name: str, scores, group_id, mask=None, **kw) -> dict:
    batch = {"scores": t(scores), "group_id": group_id}
    if mask is not None:
        batch["response_mask"] = t(mask)
    batch.update(kw.pop("batch", {}))
    return get_advantage_estimator(name)(batch, args(**kw))


# -- hand-computed -----------------------------------------------------------------------------------------------

def test_rloo_subtracts_the_mean_of_the_other_responses():
    # group 0: 1, 0, 0, 1 -> 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3; group 1 all equal -> exactly 0
    adv = estimate("rloo", [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0, 1, 1, 1, 1])["advantages"]
    torch.testing.assert_close(adv, t([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))
    assert torch.equal(adv[4:], torch.zeros(4, dtype=D))


def test_dr_grpo_centres_without_the_std_and_grpo_divides_by_the_population_std():
    scores, ids = [3.0, 1.0, 2.0, 0.0, 0.0, 0.0], [0, 0, 0, 1, 1, 1]
    torch.testing.assert_close(estimate("dr_grpo", scores, ids)["advantages"], t([1.0, -1.0, 0.0, 0, 0, 0]))
    std = math.sqrt(2 / 3)  # population std of 3, 1, 2 (ChatLearn's np.std)
    torch.testing.assert_close(estimate("grpo", scores, ids)["advantages"].double(),
                               t([1 / (std + 1e-5), -1 / (std + 1e-5), 0.0, 0, 0, 0]))


def test_groups_in_any_order_and_whole_groups_only():
    adv = estimate("rloo", [1.0, 5.0, 0.0, 3.0], [7, 9, 7, 9])["advantages"]
    torch.testing.assert_close(adv, t([1.0, 2.0, -1.0, -2.0]))
    with pytest.raises(ValueError, match="whole groups"):
        estimate("dr_grpo", [1.0, 2.0, 3.0], [0, 0, 1])


def test_reinforce_pp_returns_with_a_kl_penalty_in_the_reward():
    # two responses of 3 and 2 tokens; score at the last token; k1 KL 0.5 on every token, coef 0.1, gamma 0.5
    mask = [[1, 1, 1], [1, 1, 0]]
    lp, ref = t([[0.0, 0.0, 0.0], [0.0, 0.0, 9.0]]), t([[-0.5, -0.5, -0.5], [-0.5, -0.5, 9.0]])
    out = estimate("reinforce_pp", [1.0, 2.0], [0, 1], mask, kl_coef=0.1, gamma=0.5,
                   batch={"logprobs": lp, "ref_logprobs": ref})
    r0 = [-0.05, -0.05, 0.95]  # rewards of response 0
    g0 = [r0[0] + 0.5 * (r0[1] + 0.5 * r0[2]), r0[1] + 0.5 * r0[2], r0[2]]
    r1 = [-0.05, 1.95]
    g1 = [r1[0] + 0.5 * r1[1], r1[1], 0.0]
    torch.testing.assert_close(out["advantages"], t([g0, g1]))
    torch.testing.assert_close(out["kl"], t([[0.5, 0.5, 0.5], [0.5, 0.5, 0.0]]))
    # no penalty by default (kl_coef unset): the score at every token with gamma 1
    plain = estimate("reinforce_pp", [1.0, 2.0], [0, 1], mask)
    torch.testing.assert_close(plain["advantages"], t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    out = estimate("reinforce_pp_baseline", [1.0, 3.0, 2.0, 2.0], [0, 0, 1, 1], [[1, 1], [1, 0], [1, 1], [1, 1]])
    torch.testing.assert_close(out["advantages"], t([[-1.0, -1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))


@pytest.mark.parametrize("name, expected", [("k1", [1.0, -2.0]), ("k2", [0.5, 2.0]),
                                            ("k3", [math.exp(-1) + 1 - 1, math.exp(2) - 2 - 1])])
def test_kl_estimators(name, expected):
    lp, ref = t([0.0, 0.0]), t([-1.0, 2.0])
    torch.testing.assert_close(get_kl_estimator(name)(lp, ref), t(expected))


def test_aggregation_modes_by_hand():
    x = t([[1.0, 2.0, 3.0], [4.0, 0.0, 99.0], [7.0, 7.0, 7.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row has no response token
    assert aggregate_loss(x, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(x, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(x, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(x, mask, "seq-mean-token-sum-norm", scale=10).item() == pytest.approx((6 + 4) / 2 / 10)
    # over a global batch of 8 units, this micro-batch's share
    assert aggregate_loss(x, mask, "seq-mean-token-sum", total=8).item() == pytest.approx(10 / 8)
    with pytest.raises(ValueError, match="constant normaliser"):
        aggregate_loss(x, mask, "seq-mean-token-sum-norm")


def test_dual_clip_bounds_negative_advantages_only():
    ppo = get_policy_loss("ppo_clip")
    lp, old = t([[2.0, 2.0]]), t([[0.0, 0.0]])  # ratio e^2 = 7.39
    mask = t([[1, 1]])
    loss, st = ppo(lp, old, t([[-1.0, 1.0]]), mask, cliprange=0.2, clip_ratio_c=3.0)
    # A = -1: max(7.39, 1.2) = 7.39 -> min(7.39, 3) = 3; A = +1: max(-7.39, -1.2) = -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert st["dual_clipfrac"] == 0.5
    plain, _ = ppo(lp, old, t([[-1.0, 1.0]]), mask, cliprange=0.2)
    assert plain.item() == pytest.approx((math.exp(2) - 1.2) / 2)
    with pytest.raises(ValueError, match="must be > 1"):
        ppo(lp, old, t([[-1.0, 1.0]]), mask, cliprange=0.2, clip_ratio_c=0.5)


def test_cispo_weighs_every_token_and_never_zeroes_its_gradient():
    lp = t([[1.0, -1.0, 0.0]]).requires_grad_(True)
    old = t([[0.0, 0.0, 0.0]])  # ratios e, 1/e, 1: the first two outside [0.8, 1.28]
    adv = t([1.0])
    loss, st = get_policy_loss("cispo")(lp, old, adv, t([[1, 1, 1]]), pos_clip_ratio=0.28, neg_clip_ratio=0.2)
    loss.backward()
    # loss = -mean(w * A * lp), w = clip(ratio) as a constant: gradient -w / 3 on every token
    torch.testing.assert_close(lp.grad, t([[-1.28 / 3, -0.8 / 3, -1 / 3]]))
    assert loss.item() == pytest.approx(-(1.28 * 1.0 + 0.8 * -1.0 + 0.0) / 3)
    assert st["clipfrac"] == pytest.approx(2 / 3)


# -- verl's numbers ------------------------------------------------------------------------------------------------

def peer(case: str) -> tuple[dict, dict, dict]:
    c = PEER[case]
    return ({k: v for k, v in c["inputs"].items()}, {k: t(v) for k, v in c["outputs"].items()}, c["args"])


def outcome(inputs) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """verl's outcome estimators read the token rewards' row sums; ours the scores and integer group ids."""
    names = {}
    ids = [names.setdefault(i, len(names)) for i in inputs["index"]]
    return t(inputs["token_level_rewards"]).sum(-1), t(inputs["response_mask"]), ids


# (verl's cases with a group of one are left out: a batch here holds whole groups of one size)
@pytest.mark.parametrize("case, ours", [("grpo_no_std", "dr_grpo"), ("rloo", "rloo")])
def test_group_estimators_match_verl(case, ours):
    inputs, out, _ = peer(case)
    scores, mask, ids = outcome(inputs)
    adv = get_advantage_estimator(ours)({"scores": scores, "group_id": ids}, args())["advantages"]
    torch.testing.assert_close(adv[:, None] * mask, out["advantages"], atol=1e-12, rtol=0)


def test_grpo_uses_chatlearns_population_std_where_verl_uses_the_sample_std():
    """A documented difference: ChatLearn (np.std) and we divide by the population std, verl by torch.std."""
    inputs, out, a = peer("grpo")
    scores, mask, ids = outcome(inputs)
    ours = get_advantage_estimator("grpo")({"scores": scores, "group_id": ids}, args())["advantages"]
    n = 3  # per group; (r - mean) / std_pop vs (r - mean) / std_sample, eps aside: a factor sqrt(n / (n - 1))
    centred = get_advantage_estimator("dr_grpo")({"scores": scores, "group_id": ids}, args())["advantages"]
    verl_like = centred / (centred.view(-1, n).std(-1, unbiased=True).repeat_interleave(n) + a["epsilon"])
    torch.testing.assert_close(verl_like[:, None] * mask, out["advantages"], atol=1e-9, rtol=0)
    assert not torch.allclose(ours.double()[:, None] * mask, out["advantages"], atol=1e-3)


@pytest.mark.parametrize("case", ["reinforce_plus_plus_outcome_gamma1.0", "reinforce_plus_plus_outcome_gamma0.9",
                                  "reinforce_plus_plus_gamma1.0", "reinforce_plus_plus_gamma0.9"])
def test_reinforce_pp_returns_whitened_over_the_batch_match_verl(case):
    inputs, out, a = peer(case)
    rewards, mask = t(inputs["token_level_rewards"]), t(inputs["response_mask"])
    if "outcome" in case:  # the estimator itself, on the scores credited at the last token
        scores = rewards.sum(-1)
        res = get_advantage_estimator("reinforce_pp")({"scores": scores, "response_mask": mask,
                                                       "group_id": list(range(len(scores)))},
                                                      args(gamma=a["gamma"]))
        returns = res["returns"]
    else:  # dense per-token rewards: the returns function the estimator uses
        returns = discounted_returns(rewards, mask, a["gamma"])
    torch.testing.assert_close(returns, out["returns"], atol=1e-12, rtol=0)
    # the trainer's global-batch whitening, split into micro-batches of 2 and 4 rows
    whitened = torch.cat(whiten_global_batch([returns[:2], returns[2:]], [mask[:2], mask[2:]]))
    torch.testing.assert_close(whitened, out["advantages"], atol=1e-9, rtol=0)


def test_reinforce_pp_baseline_matches_verl():
    inputs, out, _ = peer("reinforce_plus_plus_baseline")
    scores, mask, ids = outcome(inputs)
    res = get_advantage_estimator("reinforce_pp_baseline")({"scores": scores, "response_mask": mask, "group_id": ids},
                                                           args())
    torch.testing.assert_close(whiten_global_batch([res["advantages"]], [mask])[0], out["advantages"], atol=1e-9,
                               rtol=0)


def test_gae_matches_verl():
    inputs, out, a = peer("gae")
    mask = t(inputs["response_mask"])
    adv, ret = gae_advantages_and_returns(t(inputs["token_level_rewards"]), t(inputs["values"]), mask,
                                          a["gamma"], a["lam"])
    valid = mask.bool()  # verl leaves values (returns) and whitened garbage (advantages) at padding
    torch.testing.assert_close(ret[valid], out["returns"][valid], atol=1e-12, rtol=0)
    torch.testing.assert_close(whiten_global_batch([adv], [mask])[0][valid], out["advantages"][valid], atol=1e-9,
                               rtol=0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("variant", ["", "_empty_row"])
def test_aggregation_modes_match_verl(mode, variant):
    inputs, out, a = peer(f"agg_loss_{mode}{variant}")
    x, mask = t(inputs["loss_mat"]), t(inputs["loss_mask"])
    scale = float(mask.shape[-1]) if mode == "seq-mean-token-sum-norm" else None  # verl's default: the width
    torch.testing.assert_close(aggregate_loss(x, mask, mode, scale=scale), out["loss"], atol=1e-7, rtol=0)
    if mode == "seq-mean-token-sum-norm" and not variant:
        inputs8, out8, a8 = peer("agg_loss_seq-mean-token-sum-norm_scale8")
        torch.testing.assert_close(aggregate_loss(x, mask, mode, scale=a8["loss_scale_factor"]), out8["loss"])


def _policy_case(case):
    inputs, out, a = peer(case)
    lp = t(inputs["log_prob"]).requires_grad_(True)
    return lp, t(inputs["old_log_prob"]), t(inputs["advantages"]), t(inputs["response_mask"]), out, a


def test_ppo_clip_with_dual_clip_matches_verls_vanilla_loss():
    lp, old, adv, mask, out, a = _policy_case("policy_vanilla_low0.2_high0.2_token-mean")
    loss, st = get_policy_loss("ppo_clip")(lp, old, adv, mask, cliprange=a["clip_ratio"],
                                           clip_ratio_c=a["clip_ratio_c"])
    loss.backward()
    torch.testing.assert_close(loss, out["pg_loss"], atol=1e-12, rtol=0)
    torch.testing.assert_close(lp.grad, out["grad_log_prob"], atol=1e-12, rtol=0)
    assert st["clipfrac"] == pytest.approx(out["pg_clipfrac"].item(), abs=1e-8)
    assert st["dual_clipfrac"] == pytest.approx(out["pg_clipfrac_lower"].item(), abs=1e-8) and st["dual_clipfrac"] > 0
    assert st["approx_kl"] == pytest.approx(out["ppo_kl"].item(), abs=1e-8)


@pytest.mark.parametrize("case", ["policy_cispo_low0.2_high0.28_token-mean", "policy_cispo_low0.2_high0.2_token-mean",
                                  "policy_cispo_low0.2_high0.28_seq-mean-token-mean"])
def test_cispo_matches_verl(case):
    lp, old, adv, mask, out, a = _policy_case(case)
    loss, st = get_policy_loss("cispo")(lp, old, adv, mask, pos_clip_ratio=a["clip_ratio_high"],
                                        neg_clip_ratio=a["clip_ratio_low"], loss_agg_mode=a["loss_agg_mode"])
    loss.backward()
    torch.testing.assert_close(loss, out["pg_loss"], atol=1e-7, rtol=0)
    torch.testing.assert_close(lp.grad, out["grad_log_prob"], atol=1e-7, rtol=0)
    assert st["clipfrac"] == pytest.approx(out["pg_clipfrac"].item(), abs=1e-7)


@pytest.mark.parametrize("case", ["policy_gspo_low0.0003_high0.0004_seqadv", "policy_gspo_low0.2_high0.28_seqadv"])
def test_gspo_with_sequence_mean_aggregation_matches_verl(case):
    """verl's GSPO always aggregates seq-mean-token-mean and has no final clip; ChatLearn's (ours by default)
    aggregates token-mean with the final clip. With those set as verl's, the numbers are verl's."""
    lp, old, adv, mask, out, a = _policy_case(case)
    loss, _ = get_policy_loss("gspo")(lp, old, adv, mask, pos_clip_ratio=a["clip_ratio_high"],
                                      neg_clip_ratio=a["clip_ratio_low"], final_clip_ratio=math.inf,
                                      loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    torch.testing.assert_close(loss, out["pg_loss"], atol=1e-7, rtol=0)
    torch.testing.assert_close(lp.grad, out["grad_log_prob"], atol=1e-7, rtol=0)


@pytest.mark.parametrize("ours, case", [("k1", "kl_penalty_kl"), ("k2", "kl_penalty_mse"),
                                        ("k3", "kl_penalty_low_var_kl")])
def test_kl_estimators_match_verl(ours, case):
    inputs, out, _ = peer(case)
    lp = t(inputs["logprob"]).requires_grad_(True)
    kl = get_kl_estimator(ours)(lp, t(inputs["ref_logprob"]))
    kl.sum().backward()
    torch.testing.assert_close(kl, out["kl"], atol=1e-12, rtol=0)
    torch.testing.assert_close(lp.grad, out["grad_logprob_of_sum"], atol=1e-12, rtol=0)
