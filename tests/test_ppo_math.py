"""PPO math checked against small hand-computed values (arithmetic shown in comments)."""

import math

import pytest
import torch

from chatlearn.algorithms import (
    gae_advantages_and_returns,
    get_advantage_estimator,
    get_policy_loss,
    get_value_loss,
    kl_penalized_rewards,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_clipped_policy_loss,
    ppo_clipped_value_loss,
    register_policy_loss,
    whiten_global_batch,
)
from chatlearn.algorithms.advantages import gae, grpo
from chatlearn.algorithms.aggregation import global_mean, units
from chatlearn.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSS_FAMILY,
    POLICY_LOSSES,
    advantage_estimator_inputs,
)


def close(actual: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- masked reductions

# x = [[1, 2, 3, 100(pad)], [4, 5, nan(pad), 7(pad)]]; valid entries 1..5
X = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, float("nan"), 7.0]])
M = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)


def test_masked_sum_and_mean() -> None:
    # total: 1+2+3+4+5 = 15; rows: 1+2+3 = 6, 4+5 = 9 (the NaN in padding is ignored)
    close(masked_sum(X, M), 15.0)
    close(masked_sum(X, M, dim=-1), [6.0, 9.0])
    # mean: 15/5 = 3; rows: 6/3 = 2, 9/2 = 4.5
    close(masked_mean(X, M), 3.0)
    close(masked_mean(X, M, dim=-1), [2.0, 4.5])
    # bool masks behave the same
    close(masked_mean(X, M.bool(), dim=-1), [2.0, 4.5])


def test_masked_mean_empty_row_is_zero_not_nan() -> None:
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    x = torch.tensor([[2.0, 9.0], [5.0, 5.0]])
    close(masked_mean(x, mask, dim=-1), [2.0, 0.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_var() -> None:
    # squared deviations from mean 3: 4, 1, 0, 1, 4 -> sum 10
    # biased: 10/5 = 2.0 ; unbiased: 10/4 = 2.5
    close(masked_var(X, M, unbiased=False), 2.0)
    close(masked_var(X, M), 2.5)
    # a single valid entry: Bessel undefined -> biased value (0), not a crash / NaN
    close(masked_var(torch.tensor([[7.0, 1.0]]), torch.tensor([[1.0, 0.0]])), 0.0)


def test_masked_whiten() -> None:
    # mean 3, unbiased var 2.5 -> (x - 3) / sqrt(2.5), sqrt(2.5) = 1.5811388
    # 1 -> -2/1.5811388 = -1.2649111 ; 2 -> -0.6324555 ; 3 -> 0 ; 4 -> 0.6324555 ; 5 -> 1.2649111
    w = masked_whiten(X, M)
    close(w, [[-1.2649111, -0.6324555, 0.0, 0.0], [0.6324555, 1.2649111, 0.0, 0.0]], atol=1e-5)
    assert w[0, 3] == 0 and w[1, 2] == 0 and w[1, 3] == 0  # exact zeros at padding, NaN gone
    close(masked_mean(w, M), 0.0, atol=1e-6)
    close(masked_var(w, M), 1.0, atol=1e-5)
    # shift_mean=False adds the mean (3) back: valid entries become w + 3, padding stays 0
    w_keep = masked_whiten(X, M, shift_mean=False)
    close(w_keep, [[1.7350889, 2.3675445, 3.0, 0.0], [3.6324555, 4.2649111, 0.0, 0.0]], atol=1e-5)


def test_whiten_global_batch_whitens_across_micro_batches_of_different_widths() -> None:
    # the values 1..5 of test_masked_whiten, split over two micro-batches padded to widths 3 and 2:
    # one mean (3) and one unbiased variance (2.5) over all five, as if they were one batch
    a, ma = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0, 1.0, 1.0]])
    b, mb = torch.tensor([[4.0, 9.0], [5.0, 9.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    wa, wb = whiten_global_batch([a, b], [ma, mb])
    close(wa, [[-1.2649111, -0.6324555, 0.0]], atol=1e-5)
    close(wb, [[0.6324555, 0.0], [1.2649111, 0.0]], atol=1e-5)
    assert wb[0, 1] == 0 and wb[1, 1] == 0  # padding (the 9s) excluded and zeroed
    close(torch.cat([wa.flatten(), wb[:, 0]]), masked_whiten(X, M)[M.bool()], atol=1e-6)


# ----------------------------------------------------------------------------- rewards


def test_kl_penalized_rewards_places_score_at_last_valid_token() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0])
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0], [-1.0, -1.0, -1.0]])
    ref_logprobs = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # row 0: 3 valid tokens; row 1: 1 valid token; row 2: no valid token (must not crash)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    rewards, kl = kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.1)
    # kl = logprobs - ref at valid tokens:
    #   row 0: [-1+1.5, -2+2, -3+2] = [0.5, 0, -1]
    #   row 1: [-0.5+1, pad, pad]  = [0.5, 0, 0]
    #   row 2: all padding         = [0, 0, 0]
    close(kl, [[0.5, 0.0, -1.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # rewards = -0.1 * kl, plus score at the last valid token:
    #   row 0: [-0.05, 0, 0.1 + 1.0 = 1.1]
    #   row 1: [-0.05 + 2.0 = 1.95, 0, 0]
    #   row 2: no valid token -> score dropped, all zeros
    close(rewards, [[-0.05, 0.0, 1.1], [1.95, 0.0, 0.0], [0.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- GAE


def test_gae_gamma1_lam095_single_row() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = gae_advantages_and_returns(rewards, values, mask, gamma=1.0, lam=0.95)
    # t=2 (last, V_next=0): delta = 1 + 0 - 0.7 = 0.3 ;           A2 = 0.3
    # t=1: delta = 0 + 0.7 - 0.6 = 0.1 ; A1 = 0.1 + 0.95*0.3   = 0.385
    # t=0: delta = 0 + 0.6 - 0.5 = 0.1 ; A0 = 0.1 + 0.95*0.385 = 0.46575
    close(adv, [[0.46575, 0.385, 0.3]])
    # returns = A + V = [0.96575, 0.985, 1.0]
    close(ret, [[0.96575, 0.985, 1.0]])


def test_gae_gamma09_lam05_with_padding() -> None:
    # row 1 is right-padded: position 2 holds garbage (9.0 reward, 7.0 value) that must be ignored
    rewards = torch.tensor([[0.1, 0.2, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.3, 0.4, 0.5], [1.0, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv, ret = gae_advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.5)
    # gamma*lam = 0.45
    # row 0:
    #   t=2: delta = 1.0 + 0 - 0.5         = 0.5  ; A2 = 0.5
    #   t=1: delta = 0.2 + 0.9*0.5 - 0.4   = 0.25 ; A1 = 0.25 + 0.45*0.5   = 0.475
    #   t=0: delta = 0.1 + 0.9*0.4 - 0.3   = 0.16 ; A0 = 0.16 + 0.45*0.475 = 0.37375
    # row 1 (last valid token is t=1, V after it = 0):
    #   t=1: delta = 2.0 + 0 - 0.5         = 1.5  ; A1 = 1.5
    #   t=0: delta = 0.0 + 0.9*0.5 - 1.0   = -0.55; A0 = -0.55 + 0.45*1.5 = 0.125
    #   t=2: padding -> 0
    close(adv, [[0.37375, 0.475, 0.5], [0.125, 1.5, 0.0]])
    # returns = A + V: row 0 [0.67375, 0.875, 1.0]; row 1 [1.125, 2.0, 0 (pad)]
    close(ret, [[0.67375, 0.875, 1.0], [1.125, 2.0, 0.0]])


def test_gae_ignores_nan_in_padding_and_has_no_grad() -> None:
    rewards = torch.tensor([[1.0, float("nan")]])
    values = torch.tensor([[0.25, float("nan")]], requires_grad=True)
    mask = torch.tensor([[True, False]])
    adv, ret = gae_advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.5)
    # single valid token: A = 1 + 0 - 0.25 = 0.75 ; R = 0.75 + 0.25 = 1.0
    close(adv, [[0.75, 0.0]])
    close(ret, [[1.0, 0.0]])
    assert not adv.requires_grad and not ret.requires_grad


class ExperienceArgs:
    kl_coef, gamma, lam = 0.1, 0.9, 0.5


def test_gae_estimator_penalises_kl_then_runs_gae_on_a_batch() -> None:
    # one row of 2 valid tokens (+1 padding); score 1.0; logprobs - ref = [0.2, -0.1]; kl_coef 0.1
    batch = {"scores": torch.tensor([1.0]), "response_mask": torch.tensor([[1.0, 1.0, 0.0]]),
             "logprobs": torch.tensor([[-1.0, -2.0, 0.0]]), "ref_logprobs": torch.tensor([[-1.2, -1.9, 0.0]]),
             "values": torch.tensor([[0.5, 0.25, 0.0]])}
    out = get_advantage_estimator("gae")(batch, ExperienceArgs())
    assert list(out) == ["rewards", "kl", "advantages", "returns"]
    # rewards: -0.1 * kl, plus the score at the last valid token: [-0.02, 0.01 + 1.0]
    close(out["kl"], [[0.2, -0.1, 0.0]])
    close(out["rewards"], [[-0.02, 1.01, 0.0]])
    # t=1: delta = 1.01 - 0.25 = 0.76; A1 = 0.76
    # t=0: delta = -0.02 + 0.9*0.25 - 0.5 = -0.295; A0 = -0.295 + 0.45*0.76 = 0.047
    close(out["advantages"], [[0.047, 0.76, 0.0]])
    close(out["returns"], [[0.547, 1.01, 0.0]])
    assert advantage_estimator_inputs("gae") == ("logprobs", "ref_logprobs", "values", "response_mask")


def test_estimators_are_registered_by_name_with_their_inputs() -> None:
    assert {"gae", "grpo"} <= set(ADVANTAGE_ESTIMATORS)
    assert advantage_estimator_inputs("grpo") == ("group_id",)
    with pytest.raises(KeyError, match="known: .*'gae'"):
        advantage_estimator_inputs("vtrace")


# ----------------------------------------------------------------------------- loss aggregation


def test_token_mean_weights_each_micro_batch_by_its_share_of_the_global_tokens() -> None:
    mbs = [{"response_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), "response_ids": torch.zeros(2, 3)},
           {"response_mask": torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]), "response_ids": torch.zeros(3, 2)}]
    # 4 and 4 tokens of 8; 2 and 3 sequences of 5
    assert units(mbs, "token-mean") == [4.0, 4.0]
    mean = global_mean(units(mbs, "token-mean"))
    assert mean.weights == [0.5, 0.5] and mean.total == 8.0 and mean.count == 8.0
    assert global_mean(units(mbs, "sequence-mean")).weights == [0.4, 0.6]
    # micro-batch means weighted by their shares are the global batch's mean: per-token losses 1 (mb 0) and
    # 3 (mb 1): 0.5 * 1 + 0.5 * 3 = 2 = (4 * 1 + 4 * 3) / 8
    assert sum(w * loss for w, loss in zip(mean.weights, [1.0, 3.0], strict=True)) == 2.0
    with pytest.raises(KeyError, match="known: \\['seq-mean-token-mean', .*'token-mean'\\]"):
        units(mbs, "token-sum")


def test_a_global_batch_without_units_has_zero_weights_and_a_safe_total() -> None:
    mean = global_mean([0.0, 0.0])
    assert mean.weights == [0.0, 0.0] and mean.total == 1.0 and mean.count == 0.0


# ----------------------------------------------------------------------------- policy loss

# token 0: A = +1, ratio = 1.5 (above 1+0.2) -> clipped ; token 1: A = -1, ratio = 0.9 -> inside
# token 2: padding with absurd values that must not matter
OLD_LP = torch.tensor([[0.0, 0.0, 0.0]])
NEW_LP = torch.tensor([[math.log(1.5), math.log(0.9), 50.0]])
ADV = torch.tensor([[1.0, -1.0, 100.0]])
PG_MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_ppo_clipped_policy_loss_one_clipped_one_not() -> None:
    loss, stats = ppo_clipped_policy_loss(NEW_LP, OLD_LP, ADV, PG_MASK, cliprange=0.2)
    # token 0: max(-1*1.5, -1*clip(1.5)=-1.2) = -1.2   (clipped term active)
    # token 1: max(+1*0.9, +1*clip(0.9)=0.9)  =  0.9   (not clipped)
    # loss = (-1.2 + 0.9) / 2 = -0.15 ; clipfrac = 1/2
    close(loss, -0.15)
    assert stats["clipfrac"] == pytest.approx(0.5)
    # approx_kl = mean(old - new) = (-ln 1.5 - ln 0.9)/2 = (-0.4054651 + 0.1053605)/2 = -0.1500523
    assert stats["approx_kl"] == pytest.approx(-0.1500523, abs=1e-6)
    # ratio_mean = (1.5 + 0.9)/2 = 1.2
    assert stats["ratio_mean"] == pytest.approx(1.2, abs=1e-6)
    assert set(stats) == {"clipfrac", "approx_kl", "ratio_mean"}
    assert all(isinstance(v, float) for v in stats.values())


def test_ppo_clipped_policy_loss_negative_advantage_cases() -> None:
    new = torch.tensor([[math.log(0.5), math.log(1.5)]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, -1.0]])
    loss, stats = ppo_clipped_policy_loss(new, old, adv, torch.ones(1, 2), cliprange=0.2)
    # token 0: ratio 0.5 < 0.8: max(0.5, clip->0.8) = 0.8  (clipped: no reward for pushing it lower)
    # token 1: ratio 1.5 > 1.2: max(1.5, clip->1.2) = 1.5  (not clipped: pessimistic, full penalty)
    # loss = (0.8 + 1.5)/2 = 1.15 ; clipfrac = 1/2
    close(loss, 1.15)
    assert stats["clipfrac"] == pytest.approx(0.5)


def test_ppo_policy_loss_gradient_zero_when_clipped_in_advantage_direction() -> None:
    new = NEW_LP.clone().requires_grad_(True)
    loss, _ = ppo_clipped_policy_loss(new, OLD_LP, ADV, PG_MASK, cliprange=0.2)
    loss.backward()
    # token 0: A>0 and ratio 1.5 > 1.2 -> loss term is the constant -1.2 -> d/dlogp = 0
    # token 1: unclipped, term = -A*exp(logp - old) = exp(logp); mean over 2 tokens
    #          -> d/dlogp = 0.5 * (-A) * ratio = 0.5 * 1 * 0.9 = 0.45
    # token 2: padding -> 0
    close(new.grad, [[0.0, 0.45, 0.0]])


def test_ppo_policy_loss_extreme_log_ratio_stays_finite() -> None:
    new = torch.tensor([[200.0, -200.0]], requires_grad=True)
    loss, stats = ppo_clipped_policy_loss(
        new, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), cliprange=0.2
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert math.isfinite(stats["ratio_mean"])


# ----------------------------------------------------------------------------- value loss


def test_ppo_clipped_value_loss() -> None:
    # c = 0.2; last column is padding with garbage
    values = torch.tensor([[1.1, 1.0, 1.0, 50.0]])
    old_values = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.5, 2.0, 0.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = ppo_clipped_value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # token 0 (inside band): clip(1.1, 0.8, 1.2) = 1.1 ; both (1.1-1.5)^2 = 0.16          -> 0.16
    # token 1 (clipped):     clip(1.0,-0.2, 0.2) = 0.2 ; (1.0-2)^2 = 1.0, (0.2-2)^2 = 3.24 -> 3.24
    # token 2 (clip irrelevant): vclip = 0.2 ; (1.0-0)^2 = 1.0, (0.2-0)^2 = 0.04         -> 1.0
    # loss = 0.5 * (0.16 + 3.24 + 1.0)/3 = 0.5 * 4.4/3 = 0.7333333 ; vf_clipfrac = 1/3
    close(loss, 0.7333333)
    assert stats["vf_clipfrac"] == pytest.approx(1 / 3)


def test_ppo_value_loss_unclipped_matches_half_mse() -> None:
    values = torch.tensor([[0.5, -0.5]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0]])
    loss, stats = ppo_clipped_value_loss(values, values.detach(), returns, torch.ones(1, 2), 0.2)
    # old == new -> clip is a no-op: 0.5 * ((0.5-1)^2 + (-0.5-0)^2)/2 = 0.5 * 0.5/2 = 0.125
    close(loss, 0.125)
    assert stats["vf_clipfrac"] == 0.0
    loss.backward()
    # d/dv 0.5 * mean((v-R)^2) = (v - R)/2 = [-0.25, -0.25]
    close(values.grad, [[-0.25, -0.25]])


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_from_logits() -> None:
    ln3 = math.log(3.0)
    # softmax([0, ln3]) = [1/4, 3/4]; softmax([ln3, 0]) = [3/4, 1/4]
    logits = torch.tensor([[[0.0, ln3], [ln3, 0.0]]])
    labels = torch.tensor([[1, 1]])
    # -> [ln 0.75, ln 0.25] = [-0.2876821, -1.3862944]
    close(logprobs_from_logits(logits, labels), [[-0.2876821, -1.3862944]])


def test_logprobs_from_logits_is_numerically_stable() -> None:
    # softmax([1000, 0]) = [1, e^-1000]: naive log(softmax) gives log(0) = -inf for label 1
    logits = torch.tensor([[[1000.0, 0.0], [1000.0, 0.0]]])
    labels = torch.tensor([[0, 1]])
    close(logprobs_from_logits(logits, labels), [[0.0, -1000.0]])
    # half-precision inputs are upcast so ratios are not bf16-coarse
    out = logprobs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_logprobs_from_logits_in_chunks_match_log_softmax_in_value_and_gradient(monkeypatch) -> None:
    """Chunks of 7 positions (so the last chunk is short), a temperature, and bf16 logits: the same log-probs
    and gradients as autograd through ``log_softmax(x / T).gather``, and no float32 [rows, V] kept."""
    from chatlearn.algorithms import ppo

    monkeypatch.setattr(ppo, "LOGPROB_CHUNK_ROWS", 7)
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 50, (3, 11), generator=gen)
    weights = torch.randn(3, 11, generator=gen)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5), (torch.float64, 1e-12)):
        for temperature in (1.0, 0.7):
            base = torch.randn(3, 11, 50, generator=gen) * 3
            x = base.to(dtype).requires_grad_()
            lp = logprobs_from_logits(x, labels, temperature)
            (lp * weights).sum().backward()
            ours, x.grad = x.grad, None
            wide = torch.promote_types(dtype, torch.float32)
            ref = torch.log_softmax(x.to(wide) / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
            (ref * weights).sum().backward()
            assert lp.dtype == wide and ours.dtype == dtype
            torch.testing.assert_close(lp, ref, atol=tol, rtol=0)
            torch.testing.assert_close(ours.to(wide), x.grad.to(wide), atol=tol, rtol=tol)
    # what the forward keeps for backward: the logits themselves and one float per position, nothing [rows, V]
    x = torch.randn(3, 11, 50, requires_grad=True)
    saved = logprobs_from_logits(x, labels).grad_fn.saved_tensors
    assert sorted(t.numel() for t in saved) == [33, 33, 3 * 11 * 50] and saved[0] is x


# ----------------------------------------------------------------------------- registry


def test_registry_lookup_returns_builtins() -> None:
    assert get_advantage_estimator("gae") is gae
    assert get_advantage_estimator("grpo") is grpo
    assert get_policy_loss("ppo_clip") is ppo_clipped_policy_loss
    assert get_value_loss("ppo_clip") is ppo_clipped_value_loss


@pytest.mark.parametrize(
    "getter, known",
    [(get_advantage_estimator, "gae"), (get_policy_loss, "ppo_clip"), (get_value_loss, "ppo_clip")],
)
def test_registry_unknown_name_lists_known(getter, known) -> None:
    with pytest.raises(KeyError) as info:
        getter("no_such_algo")
    message = str(info.value)
    assert "no_such_algo" in message and known in message


def test_registry_plugin_registration_and_duplicate_rejected() -> None:
    def my_loss(logprobs, old_logprobs, advantages, mask, **_):
        return masked_mean(-advantages * logprobs, mask), {}

    try:
        assert register_policy_loss("test_plugin_loss", family="ppo")(my_loss) is my_loss
        assert get_policy_loss("test_plugin_loss") is my_loss
        register_policy_loss("test_plugin_loss", family="ppo")(my_loss)  # same object again: harmless
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("ppo_clip", family="ppo")(my_loss)  # would silently replace the built-in
        with pytest.raises(ValueError, match="unknown family 'dpo'"):
            register_policy_loss("test_other_loss", family="dpo")  # a family no trainer calls
    finally:
        POLICY_LOSSES.pop("test_plugin_loss", None)
        POLICY_LOSS_FAMILY.pop("test_plugin_loss", None)
    assert get_policy_loss("ppo_clip") is ppo_clipped_policy_loss
