"""Advantage estimators: how a scored batch becomes the experience a policy trainer learns from.

One contract for every algorithm, ``fn(batch, args) -> dict``, registered by name
(:func:`~chatlearn.algorithms.registry.register_advantage_estimator`):

* ``batch``: the upstream models' outputs of one batch plus ``scores`` ``[B]`` (the reward, clipped), with
  the fields the estimator declares as its inputs (a batch without them is an error naming them);
* ``args``: the reward's experience settings (``kl_coef``, ``kl_estimator``, ``gamma``, ``lam``; each
  estimator declares the ones it reads, and a setting given to one that does not read it is a config error);
* returns the fields it adds to the experience, ``advantages`` among them: per response token ``[B, T]`` or
  per sequence ``[B]`` (the ``shape`` it registers with; a trainer takes the shapes it declares, so GRPO's
  per-sequence advantages are refused for the PPO trainer by the config check).

The built-ins (``models.reward.args_dict.advantage_estimator``; default the one the engine's trainer declares,
``default_advantage_estimator`` of its module class, so the choice is never guessed from which keys a batch
carries):

* ``gae``: PPO's, a critic's values and GAE over KL-penalised per-token rewards;
* ``grpo``: each response against its prompt's group, ``(r - mean) / (std + eps)`` (ChatLearn's population std);
* ``dr_grpo``: ``r - mean``, no std (Dr.GRPO; pair it with the trainer's ``loss_agg_mode:
  seq-mean-token-sum-norm`` for its constant normaliser, no length normalisation);
* ``rloo``: ``r - mean of the other responses to the prompt`` (leave-one-out baseline);
* ``reinforce_pp``: REINFORCE++, per-token returns of the score and a KL penalty, no baseline;
* ``reinforce_pp_baseline``: the same with the group's mean score subtracted first.

The REINFORCE++ pair's advantages are whitened over each global batch by the trainer (their registration says
so, and the config checks require the trainer's ``whiten_advantages``): the reward sees one generation batch,
the trainer the global batch the whitening is defined over.
"""

from typing import Any

import torch

from chatlearn.algorithms.grpo import by_group, group_advantages_by_id
from chatlearn.algorithms.ppo import discounted_returns, gae_advantages_and_returns, outcome_rewards
from chatlearn.algorithms.registry import get_kl_estimator, register_advantage_estimator
from chatlearn.data.batch import loss_mask

__all__ = ["dr_grpo", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "DEFAULT_KL_COEF"]

# the reward's KL penalty when kl_coef is not set: PPO's 0.02 (ChatLearn's init_kl_coef); none elsewhere
DEFAULT_KL_COEF = {"gae": 0.02}


def kl_coef(args: Any, estimator: str) -> float:
    """The reward KL penalty's weight: ``args.kl_coef``, else the estimator's default (0 but for ``gae``)."""
    value = getattr(args, "kl_coef", None)
    return float(DEFAULT_KL_COEF.get(estimator, 0.0) if value is None else value)


def _reward_kl(batch: dict[str, Any], args: Any, coef: float) -> torch.Tensor | None:
    """The per-token KL of ``args.kl_estimator`` (k1 by default), 0 at padding; None without a penalty."""
    if coef <= 0:
        return None
    mask = loss_mask(batch).bool()  # not at a multi-turn sample's observations, which the policy did not write
    kl = get_kl_estimator(getattr(args, "kl_estimator", None) or "k1")(batch["logprobs"], batch["ref_logprobs"])
    return torch.where(mask, kl, torch.zeros((), dtype=kl.dtype)).detach()


def _reported_kl(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The policy-reference log-ratio on response tokens, reported (not a penalty) when both are in the batch."""
    if "ref_logprobs" in batch and "logprobs" in batch:
        return {"kl": (batch["logprobs"] - batch["ref_logprobs"]) * loss_mask(batch)}
    return {}


def _zero_where_constant(grouped: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``adv``, exactly 0 (not rounding noise) for the groups whose scores are all equal."""
    constant = grouped.amax(-1, keepdim=True) == grouped.amin(-1, keepdim=True)
    return torch.where(constant, torch.zeros_like(adv), adv)


def _centred(grouped: torch.Tensor) -> torch.Tensor:
    return _zero_where_constant(grouped, grouped - grouped.mean(-1, keepdim=True))


def _leave_one_out(grouped: torch.Tensor) -> torch.Tensor:
    n = grouped.shape[-1]
    if n < 2:  # no other response to compare with: the score itself, as verl does
        return grouped
    others = (grouped.sum(-1, keepdim=True) - grouped) / (n - 1)
    return _zero_where_constant(grouped, grouped - others)


@register_advantage_estimator("gae", shape="token", inputs=("logprobs", "ref_logprobs", "values", "response_mask"),
                              settings=("kl_coef", "kl_estimator", "gamma", "lam"))
def gae(batch: dict[str, Any], args: Any) -> dict[str, torch.Tensor]:
    """PPO's experience: per-token rewards (the score at the last token, a KL penalty to the reference on
    every token, ``kl_coef`` times ``kl_estimator``'s estimate), then GAE (``gamma``, ``lam``) over the
    critic's values.

    Returns ``rewards``, ``kl``, ``advantages`` and ``returns``, each ``[B, T]`` and 0 at padding."""
    mask = batch["response_mask"]  # GAE runs over the whole trajectory, observations included (their reward is 0)
    coef = kl_coef(args, "gae")
    kl = _reward_kl(batch, args, coef)
    if kl is None:  # no penalty: the k1 log-ratio is still reported
        kl = _reported_kl(batch)["kl"]
        rewards = outcome_rewards(batch["scores"], mask)
    else:
        rewards = outcome_rewards(batch["scores"], mask, -coef * kl)
    adv, ret = gae_advantages_and_returns(rewards=rewards, values=batch["values"], mask=mask, gamma=args.gamma,
                                          lam=args.lam)
    return {"rewards": rewards, "kl": kl, "advantages": adv, "returns": ret}


@register_advantage_estimator("grpo", shape="sequence", inputs=("group_id",))
def grpo(batch: dict[str, Any], args: Any) -> dict[str, torch.Tensor]:
    """GRPO's experience: no critic, each response judged against the other responses to its prompt
    (``advantages`` ``[B]``, ``(r - mean) / (std + 1e-5)`` per group, population std as ChatLearn). With the
    policy's and reference's log-probs in the batch, ``kl`` ``[B, T]`` (their difference on response tokens)
    is reported too, not a reward penalty."""
    return {"advantages": group_advantages_by_id(batch["scores"], batch["group_id"]), **_reported_kl(batch)}


@register_advantage_estimator("dr_grpo", shape="sequence", inputs=("group_id",))
def dr_grpo(batch: dict[str, Any], args: Any) -> dict[str, torch.Tensor]:
    """Dr.GRPO's (GRPO without the std): ``r - mean`` of the prompt's group, ``[B]``; ``kl`` as ``grpo``."""
    return {"advantages": by_group(batch["scores"], batch["group_id"], _centred), **_reported_kl(batch)}


@register_advantage_estimator("rloo", shape="sequence", inputs=("group_id",))
def rloo(batch: dict[str, Any], args: Any) -> dict[str, torch.Tensor]:
    """RLOO's: each response's score minus the mean of the other responses to its prompt, ``[B]`` (equal to
    ``n / (n - 1) * (r - mean)``); ``kl`` as ``grpo``."""
    return {"advantages": by_group(batch["scores"], batch["group_id"], _leave_one_out), **_reported_kl(batch)}


def _reinforce(batch: dict[str, Any], args: Any, scores: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    mask, coef = loss_mask(batch), kl_coef(args, name)
    kl = _reward_kl(batch, args, coef)
    penalty = None if kl is None else -coef * kl
    rewards = outcome_rewards(scores, mask, penalty)
    returns = discounted_returns(rewards, mask, args.gamma)
    out = {"rewards": rewards, "advantages": returns, "returns": returns}
    if kl is not None:
        out["kl"] = kl
    else:
        out.update(_reported_kl(batch))
    return out


@register_advantage_estimator("reinforce_pp", shape="token", inputs=("response_mask",),
                              settings=("kl_coef", "kl_estimator", "gamma"), whiten=True)
def reinforce_pp(batch: dict[str, Any], args: Any) -> dict[str, torch.Tensor]:
    """REINFORCE++'s: per-token rewards (the score at the last token, ``-kl_coef`` times the KL estimate on
    every token; no penalty when ``kl_coef`` is 0, the default), their discounted returns (``gamma``) as the
    advantages ``[B, T]``, no baseline; the trainer whitens them over the global batch."""
    return _reinforce(batch, args, batch["scores"], "reinforce_pp")


@register_advantage_estimator("reinforce_pp_baseline", shape="token", inputs=("group_id", "response_mask"),
                              settings=("kl_coef", "kl_estimator", "gamma"), whiten=True)
def reinforce_pp_baseline(batch: dict[str, Any], args: Any) -> dict[str, torch.Tensor]:
    """REINFORCE++-baseline's: ``reinforce_pp`` on the scores minus their prompt group's mean (its baseline)."""
    centred = by_group(batch["scores"], batch["group_id"], _centred)
    return _reinforce(batch, args, centred, "reinforce_pp_baseline")
