"""GRPO / GSPO / DPO / online-DPO math checked against hand-computed values (arithmetic in comments).

Expected numbers are written out or computed with plain ``math`` here, never by calling the
function under test.  Tensors are float64 so the comparisons can be tight.
"""

import math

import pytest
import torch

from chatlearn.algorithms.dpo import dpo_loss, online_dpo_loss, online_dpo_pairs, sequence_logprob
from chatlearn.algorithms.grpo import (
    entropy_from_logits,
    group_advantages,
    grpo_token_loss,
    gspo_sequence_loss,
    k3_kl,
)
from chatlearn.algorithms.registry import get_advantage_estimator, get_policy_loss

D = torch.float64
NAN = float("nan")


def t(values, dtype=D) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol: float = 1e-9) -> None:
    if not isinstance(actual, torch.Tensor):
        assert actual == pytest.approx(expected, abs=atol)
        return
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# ----------------------------------------------------------------------------- group advantages


def test_grpo_estimator_normalises_scores_in_each_prompt_group_and_reports_kl() -> None:
    # groups by id, not by position: group 7 = scores [1, 3], group 2 = [2, 2] (tied)
    batch = {"scores": t([1.0, 2.0, 3.0, 2.0]), "group_id": [7, 2, 7, 2],
             "response_mask": t([[1, 1], [1, 0], [1, 1], [1, 0]]),
             "logprobs": t([[-1.0, -2.0], [-1.0, 5.0], [-0.5, -0.5], [-3.0, 5.0]]),
             "ref_logprobs": t([[-1.5, -2.0], [-1.0, 0.0], [-1.0, -0.25], [-2.0, 0.0]])}
    out = get_advantage_estimator("grpo")(batch, None)
    assert list(out) == ["advantages", "kl"]
    # group 7: mean 2, population std 1 -> (1 - 2) / (1 + 1e-5), (3 - 2) / (1 + 1e-5); group 2 tied -> exactly 0
    close(out["advantages"], [-1 / (1 + 1e-5), 0.0, 1 / (1 + 1e-5), 0.0], atol=1e-12)
    # kl = logprobs - ref on response tokens (reported, not a penalty); padding -> 0
    close(out["kl"], [[0.5, 0.0], [0.0, 0.0], [0.5, -0.25], [-1.0, 0.0]])
    without_ref = get_advantage_estimator("grpo")({k: batch[k] for k in ("scores", "group_id", "response_mask")}, None)
    assert list(without_ref) == ["advantages"]


def test_group_advantages_population_std_and_exact_zero_for_tied_group() -> None:
    adv = group_advantages(t([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]), group_size=4)
    # group 1: mean 0.5, population std sqrt(mean((+-0.5)^2)) = 0.5 (np.std, ddof=0 as ChatLearn);
    # the unbiased std would be sqrt(1/3) = 0.577 and give +-0.866 instead.
    a = 0.5 / (0.5 + 1e-5)
    close(adv[:4], [a, -a, -a, a], atol=1e-12)
    # group 2: all equal -> exactly zero, not just small
    assert torch.equal(adv[4:], torch.zeros(4, dtype=D))


def test_group_advantages_uneven_group_and_rounding_prone_tie() -> None:
    # [0, 1, 2]: mean 1, population std sqrt(2/3)
    s = math.sqrt(2.0 / 3.0)
    # [0.1] * 3 in float32: the mean may not round-trip exactly, the result must still be exact 0
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0, 0.1, 0.1, 0.1]), group_size=3)
    close(adv[:3], [-1 / (s + 1e-5), 0.0, 1 / (s + 1e-5)], atol=1e-6)
    assert torch.equal(adv[3:], torch.zeros(3))
    # integer rewards are accepted and a group of 1 has std 0 -> advantage 0
    assert torch.equal(group_advantages(torch.tensor([3, 7]), group_size=1), torch.zeros(2))


def test_group_advantages_rejects_partial_group() -> None:
    with pytest.raises(ValueError, match=r"7.*3"):
        group_advantages(torch.zeros(7), group_size=3)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), group_size=0)
    with pytest.raises(ValueError, match="7.*3"):
        online_dpo_pairs(torch.zeros(7), group_size=3)


# ----------------------------------------------------------------------------- GRPO token loss


def test_grpo_clip_higher_is_asymmetric() -> None:
    # old log-probs -1 everywhere; new = old + log(ratio).  Third column is NaN padding.
    ratios = [[1.5, 1.1], [0.5, 0.9]]
    old = t([[-1.0, -1.0, NAN], [-1.0, -1.0, NAN]])
    new = t([[-1.0 + math.log(r) for r in row] + [NAN] for row in ratios]).requires_grad_()
    mask = t([[1, 1, 0], [1, 1, 0]])
    adv = t([1.0, -1.0])  # per sequence

    loss, st = grpo_token_loss(new, old, adv, mask, pos_clip_ratio=0.28, neg_clip_ratio=0.2)
    # A=+1, r=1.5: max(-1.5, -1.28) = -1.28 (clipped at 1 + 0.28)   A=+1, r=1.1: -1.1
    # A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped at 1 - 0.2)           A=-1, r=0.9:  0.9
    close(loss, (-1.28 - 1.1 + 0.8 + 0.9) / 4)
    close(st["clipfrac"], 2 / 4)
    close(st["pos_clipfrac"], 1 / 4)
    close(st["neg_clipfrac"], 1 / 4)
    close(st["ratio_mean"], (1.5 + 1.1 + 0.5 + 0.9) / 4)
    # approx_kl = mean(old - new) = -mean(log r)
    close(st["approx_kl"], -(math.log(1.5) + math.log(1.1) + math.log(0.5) + math.log(0.9)) / 4)

    loss.backward()
    # d/dlogp of -A * r is -A * r at unclipped tokens, 0 at clipped ones and at padding
    close(new.grad, [[0.0, -1.1 / 4, 0.0], [0.0, 0.9 / 4, 0.0]])

    # the symmetric default clips the positive token at 1.2 instead of 1.28
    loss_sym, _ = grpo_token_loss(new.detach(), old, adv, mask)
    close(loss_sym, (-1.2 - 1.1 + 0.8 + 0.9) / 4)


def test_grpo_final_clip_bounds_the_loss_value_for_any_sign() -> None:
    # log-ratios 1, 0, 1, 1.2 and 50 (clamped by diff_clip_ratio=10 before exp, so no overflow)
    log_r = [1.0, 0.0, 1.0, 1.2, 50.0]
    adv = t([[-2.0, -2.0, 2.0, -0.5, -1.0]])
    old = torch.zeros(1, 5, dtype=D)
    new = t([log_r]).requires_grad_()
    mask = torch.ones(1, 5, dtype=D)

    loss, st = grpo_token_loss(new, old, adv, mask)
    e12 = math.exp(1.2)
    # A=-2, r=e:      max(2e, 1.6) = 5.44 -> min(., 3) = 3 (bounded)
    # A=-2, r=1:      2 (below the bound)
    # A=+2, r=e:      max(-2e, -2.4) = -2.4 (negative, never bounded)
    # A=-0.5, r=e^1.2: 0.5 * 3.32 = 1.66; the bound is on the loss value (3), not on the ratio:
    #                 a dual-clip on the ratio (c * |A| = 1.5) would have cut it
    # A=-1, r=e^10:   e^10 -> 3
    per_token = [3.0, 2.0, -2.4, 0.5 * e12, 3.0]
    close(loss, sum(per_token) / 5)
    close(st["final_clipfrac"], 2 / 5)
    assert math.isfinite(st["ratio_mean"])

    loss.backward()
    # bounded tokens get no gradient; A=-2, r=1 gets 2 * 1 / 5; A=-0.5 gets 0.5 * e^1.2 / 5
    close(new.grad, [[0.0, 2.0 / 5, 0.0, 0.5 * e12 / 5, 0.0]])

    # disabling the bound
    loss_inf, _ = grpo_token_loss(new.detach(), old, adv, mask, final_clip_ratio=float("inf"))
    close(loss_inf, (2 * math.e + 2.0 - 2.4 + 0.5 * e12 + math.exp(10.0)) / 5)


def test_grpo_accepts_per_token_advantages_and_rejects_bad_shapes() -> None:
    new = t([[0.0, math.log(1.1)]])
    old = torch.zeros(1, 2, dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    loss, _ = grpo_token_loss(new, old, t([[1.0, -1.0]]), mask)
    close(loss, (-1.0 + 1.1) / 2)
    with pytest.raises(ValueError, match="advantages"):
        grpo_token_loss(new, old, t([1.0, 2.0]), mask)
    with pytest.raises(ValueError, match="units must be > 0"):
        grpo_token_loss(new, old, t([1.0]), mask, total=0)


def test_registered_policy_losses() -> None:
    assert get_policy_loss("grpo") is grpo_token_loss
    assert get_policy_loss("gspo") is gspo_sequence_loss


# ----------------------------------------------------------------------------- GSPO


def test_gspo_uses_sequence_ratio_with_per_token_gradient() -> None:
    # seq 0 token log-ratios 0.1, 0.3 (+ padding) -> s0 = 0.2; seq 1: -0.2 (+ 2 padding) -> s1 = -0.2
    old = t([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]])
    new = t([[-0.9, -1.7, NAN], [-0.7, NAN, NAN]]).requires_grad_()
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv = t([1.0, -1.0])
    # wide clips and no final bound so the raw ratio is visible
    loss, st = gspo_sequence_loss(
        new, old, adv, mask, pos_clip_ratio=5.0, neg_clip_ratio=0.9, final_clip_ratio=float("inf")
    )
    r0, r1 = math.exp(0.2), math.exp(-0.2)
    # each token of seq 0 contributes -1 * r0, the token of seq 1 contributes +1 * r1; 3 tokens
    close(loss, (-2 * r0 + r1) / 3)
    close(st["ratio_mean"], (2 * r0 + r1) / 3)  # every token's ratio is its sequence's ratio
    close(st["clipfrac"], 0.0)
    close(st["approx_kl"], -(0.1 + 0.3 - 0.2) / 3)  # still per token

    loss.backward()
    # d loss / d logprob_t = -A * r_seq / 3, non-zero for every valid token (not 1/|y| of it)
    close(new.grad, [[-r0 / 3, -r0 / 3, 0.0], [r1 / 3, 0.0, 0.0]])


def test_gspo_equals_token_loss_when_log_ratios_are_equal_within_sequences() -> None:
    old = t([[-1.0, -2.0], [-1.0, -3.0]])
    lr = t([[0.5, 0.5], [-0.4, -0.4]])
    mask = torch.ones(2, 2, dtype=D)
    adv = t([1.0, -1.0])
    new_tok = (old + lr).requires_grad_()
    new_seq = (old + lr).requires_grad_()
    loss_tok, st_tok = grpo_token_loss(new_tok, old, adv, mask)
    loss_seq, st_seq = gspo_sequence_loss(new_seq, old, adv, mask)
    # seq 0: r = e^0.5 = 1.65 -> clipped to 1.2 -> -1.2 per token; seq 1: r = e^-0.4 = 0.67 -> 0.8
    close(loss_seq, (-1.2 * 2 + 0.8 * 2) / 4)
    close(loss_seq, loss_tok.item())
    assert st_seq == pytest.approx(st_tok)
    loss_tok.backward()
    loss_seq.backward()
    torch.testing.assert_close(new_seq.grad, new_tok.grad)


# ----------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize("loss_fn", [grpo_token_loss, gspo_sequence_loss])
def test_micro_batch_losses_sum_to_global_batch_loss(loss_fn) -> None:
    old = t([[-1.0, -2.0, -1.5, -0.5], [-0.3, -0.2, 0, 0], [-2.0, 0, 0, 0], [-1.0, -1.0, -1.0, 0]])
    new = old + t([[0.3, -0.1, 0.05, 0.2], [-0.4, 0.1, 0, 0], [0.25, 0, 0, 0], [0.1, -0.3, 0.0, 0]])
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    adv = t([1.0, -0.5, 2.0, -1.5])
    whole, _ = loss_fn(new, old, adv, mask)
    # 10 valid tokens in the global batch; micro-batch 2 is cut to its own width (3)
    first, _ = loss_fn(new[:2], old[:2], adv[:2], mask[:2], total=10)
    second, _ = loss_fn(new[2:, :3], old[2:, :3], adv[2:], mask[2:, :3], total=10)
    close(first + second, whole.item(), atol=1e-12)
    # the naive mean of per-micro-batch means (6 and 4 tokens) weights tokens unequally
    mean_first, _ = loss_fn(new[:2], old[:2], adv[:2], mask[:2])
    mean_second, _ = loss_fn(new[2:, :3], old[2:, :3], adv[2:], mask[2:, :3])
    assert abs((mean_first + mean_second).item() / 2 - whole.item()) > 1e-3


def test_empty_mask_gives_zero_loss() -> None:
    z = torch.zeros(2, 3, dtype=D)
    loss, st = grpo_token_loss(z.clone().requires_grad_(), z, t([1.0, -1.0]), z)
    assert loss.item() == 0.0 and st["clipfrac"] == 0.0


# ----------------------------------------------------------------------------- k3 KL and entropy


def test_k3_kl_values_sign_and_clamp() -> None:
    logp = t([-1.0, -1.0, -2.0, 0.0, -50.0]).requires_grad_()
    ref = t([-1.0, -2.0, -1.0, -50.0, 0.0])
    kl = k3_kl(logp, ref)
    # log_ratio = ref - logp: 0, -1, 1, -50, 50;  k3 = e^x - x - 1
    close(kl, [0.0, math.exp(-1) + 1 - 1, math.e - 1 - 1, 10.0, 10.0], atol=1e-12)
    assert kl[0].item() == 0.0 and (kl[1:] > 0).all()
    kl.sum().backward()
    # d k3 / d logp = -(e^x - 1) = 1 - e^x; clamped entries get 0, and no NaN from exp overflow
    close(logp.grad, [0.0, 1 - math.exp(-1), 1 - math.e, 0.0, 0.0], atol=1e-12)


def test_entropy_from_logits() -> None:
    logits = t(
        [
            [[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]],
            [[5.0, 5.0, -math.inf, -math.inf], [100.0, 0.0, 0.0, 0.0]],
        ]
    )
    ent = entropy_from_logits(logits)
    # uniform over 4: ln 4; p = (1/4, 3/4): -(1/4 ln 1/4 + 3/4 ln 3/4); two equal logits + -inf: ln 2;
    # one logit 100 above the rest: ~0 (3 * e^-100 * 100 ~ 1e-41)
    h2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(ent, [[math.log(4), h2], [math.log(2), 0.0]], atol=1e-12)
    half = entropy_from_logits(torch.zeros(1, 1, 8, dtype=torch.bfloat16))
    assert half.dtype == torch.float32
    close(half, [[math.log(8)]], atol=1e-6)


# ----------------------------------------------------------------------------- DPO


def test_sequence_logprob_sum_and_mean() -> None:
    logp = t([[-1.0, -2.0, NAN], [-3.0, NAN, 7.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    close(sequence_logprob(logp, mask), [-3.0, -3.0])
    close(sequence_logprob(logp, mask, length_normalize=True), [-1.5, -3.0])


def test_dpo_sigmoid_label_smoothing_ipo_and_metrics() -> None:
    pc = t([-1.0, -4.0]).requires_grad_()
    pr = t([-3.0, -2.0])
    rc = t([-2.0, -3.0])
    rr = t([-2.5, -3.0])
    # logits = (pc - pr) - (rc - rr): pair 1: 2 - 0.5 = 1.5; pair 2: -2 - 0 = -2
    loss, st = dpo_loss(pc, pr, rc, rr, beta=0.1)
    close(loss, (-logsigmoid(0.15) - logsigmoid(-0.2)) / 2)
    # rewards = 0.1 * (policy - ref): chosen 0.1, -0.1; rejected -0.05, 0.1
    close(st["reward_accuracy"], 0.5)
    close(st["reward_margin"], ((0.1 + 0.05) + (-0.1 - 0.1)) / 2)
    close(st["chosen_reward"], 0.0)
    close(st["rejected_reward"], 0.025)
    loss.backward()
    # d/dpc of -logsigmoid(b x) / 2 = -b * sigmoid(-b x) / 2
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    close(pc.grad, [-0.1 * sig(-0.15) / 2, -0.1 * sig(0.2) / 2])

    ls_loss, _ = dpo_loss(pc.detach(), pr, rc, rr, beta=0.1, label_smoothing=0.1)
    per_pair = [-0.9 * logsigmoid(0.1 * x) - 0.1 * logsigmoid(-0.1 * x) for x in (1.5, -2.0)]
    close(ls_loss, sum(per_pair) / 2)

    # IPO: (logits - 1 / (2 * 0.1))^2 = (1.5 - 5)^2 = 12.25 and (-2 - 5)^2 = 49
    ipo_loss, _ = dpo_loss(pc.detach(), pr, rc, rr, beta=0.1, ipo=True)
    close(ipo_loss, (12.25 + 49.0) / 2)

    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.1, ipo=True)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)


# ----------------------------------------------------------------------------- online DPO


def test_online_dpo_pairs_do_not_shift_after_a_tied_group() -> None:
    # groups of 3: [1, 0, 2] | [5, 5, 5] (no ordered pair) | [0, 1, 1] (7 and 8 tie)
    rewards = t([1.0, 0.0, 2.0, 5.0, 5.0, 5.0, 0.0, 1.0, 1.0])
    pairs = online_dpo_pairs(rewards, group_size=3)
    assert pairs == [(0, 1), (2, 0), (2, 1), (7, 6), (8, 6)]

    scores = t([0.0, -0.5, 0.2, 9.0, 9.0, 9.0, -1.0, -0.2, -1.5]).requires_grad_()
    # s_i - s_j: 0.5, 0.2, 0.7, 0.8, -0.5.  ChatLearn's offset bug would have read the third
    # group's scores from indices 3..5 (all 9) and got differences of 0.
    diffs = [0.5, 0.2, 0.7, 0.8, -0.5]
    loss, st = online_dpo_loss(scores, pairs, beta=0.1)
    close(loss, sum(-logsigmoid(0.1 * d) for d in diffs) / 5)
    close(st["num_pairs"], 5.0)
    close(st["pair_accuracy"], 4 / 5)
    close(st["margin"], sum(diffs) / 5)
    loss.backward()
    assert torch.equal(scores.grad[3:6], torch.zeros(3, dtype=D))
    assert (scores.grad[6:] != 0).all()

    ipo, _ = online_dpo_loss(scores.detach(), pairs, beta=0.1, ipo=True)
    close(ipo, sum((d - 5.0) ** 2 for d in diffs) / 5)


def test_online_dpo_without_pairs_is_zero_but_differentiable() -> None:
    assert online_dpo_pairs(t([1.0, 1.0, 2.0, 2.0]), group_size=2) == []
    scores = t([0.3, -0.2]).requires_grad_()
    loss, st = online_dpo_loss(scores, [], beta=0.1)
    assert loss.item() == 0.0 and loss.requires_grad and st["num_pairs"] == 0.0
    loss.backward()
    assert torch.equal(scores.grad, torch.zeros(2, dtype=D))
    with pytest.raises(ValueError, match="invalid pair"):
        online_dpo_loss(scores, [(0, 2)])
