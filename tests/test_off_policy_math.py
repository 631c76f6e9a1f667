"""The off-policy corrections (chatlearn.algorithms.off_policy) on hand-computed ratios, and their weights in the
GRPO/GSPO losses."""

import math

import pytest
import torch

from chatlearn.algorithms import get_policy_loss, get_rollout_correction, logprob_mismatch

NAN = float("nan")
# proximal - behaviour per token: sequence 0 has ratios 2, 0.5, 9; sequence 1 has 1.5, 0.25 and a padding slot
RATIOS = [[2.0, 0.5, 9.0], [1.5, 0.25, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _inputs():
    behaviour = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, NAN]])  # garbage at padding
    proximal = behaviour + torch.log(torch.tensor(RATIOS))
    return proximal, behaviour


# cap 3 (token bounds [1/3, 3]); token stats over the 5 valid tokens (ratios 2, .5, 9, 1.5, .25: mean 2.65),
# sequence stats over the 2 sequences (ratios 2*.5*9 = 9 and 1.5*.25 = .375: mean 4.6875)
CASES = {
    "tis_token": ([[2, .5, 3], [1.5, .25, 0]], 2.65, 9.0, 1 / 5),
    "mis_token": ([[2, .5, 0], [1.5, 0, 0]], 2.65, 9.0, 2 / 5),
    "decoupled": ([[2, .5, 0], [1.5, .25, 0]], 2.65, 9.0, 1 / 5),
    "tis_seq": ([[3, 3, 3], [.375, .375, 0]], 4.6875, 9.0, 1 / 2),
    "mis_seq": ([[0, 0, 0], [.375, .375, 0]], 4.6875, 9.0, 1 / 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_correction_weighs_and_counts_as_computed_by_hand(name):
    weights, mean, top, clipped = CASES[name]
    proximal, behaviour = _inputs()
    got, stats = get_rollout_correction(name)(proximal, behaviour, MASK, cap=3.0)
    torch.testing.assert_close(got, torch.tensor(weights, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    assert stats == pytest.approx({"rollout_is_ratio_mean": mean, "rollout_is_ratio_max": top,
                                   "rollout_is_clipped_frac": clipped}, rel=1e-5)
    assert not got.requires_grad


def test_the_sampler_trainer_mismatch_as_computed_by_hand():
    """Trainer (proximal) against sampler (behaviour) on the 5 valid tokens: |log r| = ln 2, ln 2, ln 9, ln 1.5,
    ln 4; k3 = r - 1 - ln r per token; the padding slot's garbage is left out."""
    proximal, behaviour = _inputs()
    ratios = [2.0, 0.5, 9.0, 1.5, 0.25]
    stats = logprob_mismatch(proximal, behaviour, MASK)
    assert stats == pytest.approx({"rollout_logprob_diff_mean": sum(abs(math.log(r)) for r in ratios) / 5,
                                   "rollout_logprob_diff_max": math.log(9.0),
                                   "rollout_kl": sum(r - 1 - math.log(r) for r in ratios) / 5}, rel=1e-5)
    assert logprob_mismatch(behaviour, behaviour, MASK) == {"rollout_logprob_diff_mean": 0.0,
                                                            "rollout_logprob_diff_max": 0.0, "rollout_kl": 0.0}


def test_a_huge_sequence_ratio_is_reported_finite_and_the_cap_is_checked():
    behaviour = torch.full((1, 40), -5.0)
    weights, stats = get_rollout_correction("tis_seq")(behaviour + 3.0, behaviour, torch.ones(1, 40))  # e^120
    assert torch.all(weights == 2.0) and math.isfinite(stats["rollout_is_ratio_max"])
    with pytest.raises(ValueError, match="cap must be > 1"):
        get_rollout_correction("tis_token")(behaviour, behaviour, torch.ones(1, 40), cap=1.0)


@pytest.mark.parametrize("loss_name", ["grpo", "gspo"])
def test_the_losses_weigh_each_tokens_loss_and_no_gradient_flows_through_the_weights(loss_name):
    loss_fn = get_policy_loss(loss_name)
    torch.manual_seed(0)
    old = torch.randn(2, 3)
    mask = MASK.float()
    adv = torch.tensor([1.0, -0.5])
    new = (old + 0.05 * torch.randn(2, 3)).requires_grad_(True)
    plain, _ = loss_fn(new, old, adv, mask, total=5.0)
    ones, _ = loss_fn(new, old, adv, mask, total=5.0, token_weights=torch.ones(2, 3))
    assert torch.equal(plain, ones)
    # a weight of 0 on sequence 1: the loss of sequence 0 alone, still over the batch's 5 tokens
    weights = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], requires_grad=True)
    only0, _ = loss_fn(new, old, adv, mask, total=5.0, token_weights=weights)
    alone, _ = loss_fn(new[:1], old[:1], adv[:1], mask[:1], total=5.0)
    torch.testing.assert_close(only0, alone)
    only0.backward()
    assert weights.grad is None and new.grad is not None and torch.all(new.grad[1] == 0)
