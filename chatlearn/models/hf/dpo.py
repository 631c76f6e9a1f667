"""DPO and online DPO: the pair reference and the two trainers (ChatLearn's DPOEngine and OnlineDPOEngine).

A preference pair is one sample: the prompt, the chosen response as ``response_ids``/``response_mask`` and the
rejected one as ``rejected_ids``/``rejected_mask`` (see :mod:`chatlearn.data.batch`). Offline DPO reads the
pairs from JSONL (``prompt``, ``chosen``, ``rejected``); the reference adds its log-probs of both responses and
the trainer minimises the sigmoid (or IPO) loss of :func:`chatlearn.algorithms.dpo.dpo_loss`.

Online DPO has no stored pairs: the policy samples a group of responses per prompt, the reward scores them, and
every pair of the group with a strictly higher reward is a (chosen, rejected) pair, compared by
length-normalised (policy - reference) log-probs (:func:`chatlearn.algorithms.dpo.online_dpo_loss`).
"""

from typing import Any

import torch
from pydantic import Field

from chatlearn.algorithms.aggregation import GlobalMean, global_mean
from chatlearn.algorithms.dpo import dpo_loss, online_dpo_loss, sequence_logprob
from chatlearn.data.records import Records
from chatlearn.models.hf.common import (
    HFModelArgs,
    HFModule,
    ensure_model_files,
    load_causal_lm,
    load_tokenizer,
    packed_tokens_of,
    response_logprobs,
)
from chatlearn.models.hf.packing import row_chunks, rows
from chatlearn.models.hf.trainer import CausalLMTrainer, OptimArgs


class PairArgs(HFModelArgs):
    prompt_key: str = Field("prompt", description="field of a pair record that holds the prompt text")
    chosen_key: str = Field("chosen", description="field of a pair record that holds the preferred response")
    rejected_key: str = Field("rejected", description="field of a pair record that holds the other response")
    max_response_tokens: int = Field(256, gt=0, description="longer responses are an error naming the record")
    truncate_long_prompts: bool = Field(
        False, description="a prompt that with its longer response (and EOS) exceeds the model's context "
        "(max_position_embeddings) is cut to fit, keeping its end; default: an error naming its file and line, "
        "found before anything starts")


def rejected_view(batch: dict) -> dict:
    """The batch with the rejected response in the response slots (for the shared log-prob code)."""
    return {"prompt_ids": batch["prompt_ids"], "prompt_mask": batch["prompt_mask"],
            "response_ids": batch["rejected_ids"], "response_mask": batch["rejected_mask"]}


def pair_logprobs(model, batch: dict, device: torch.device, temperature: float, packed: bool = False,
                  budget: int | None = None, rejected_model=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, R] of the chosen and [B, R'] of the rejected responses. Padded: a forward per side, the
    rejected one on ``rejected_model`` when given (a DDP wrapper prepares its gradient reduction in its
    forward, once per backward: the second pass runs on the module itself, same parameters). Packed: both
    sides in ONE forward (in rows of at most ``budget`` tokens; one when None)."""
    if not packed:
        return (response_logprobs(model, batch, device, temperature),
                response_logprobs(rejected_model or model, rejected_view(batch), device, temperature))
    chunks = [slice(None)] if budget is None else row_chunks(batch, budget, lambda b: [b, rejected_view(b)])
    parts = [packed_tokens_of(model, [rows(batch, c), rejected_view(rows(batch, c))], device, temperature)
             for c in chunks]
    return torch.cat([c.logprobs for c, _ in parts]), torch.cat([r.logprobs for _, r in parts])


class PairReference(HFModule):
    """The DPO engine's first model: owns the pair dataset, tokenises pairs, adds frozen log-probs of both."""

    args_schema = PairArgs
    supports_packing = True

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.tokenizer = load_tokenizer(self.args.model_path)
        self.model = load_causal_lm(self.args.model_path, self.args.dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.parallelize()

    def build_dataset(self, prompts, is_eval=False):
        if isinstance(prompts, Records):  # checked on the driver, and read lazily: materialised here, it would not be
            return prompts
        a = self.args
        for i, rec in enumerate(prompts):
            for key in (a.prompt_key, a.chosen_key, a.rejected_key):
                if not isinstance(rec, dict) or not isinstance(rec.get(key), str):
                    which = "eval" if is_eval else "train"
                    raise ValueError(f"{self.name}: {which} pair record {i} has no string field {key!r} (a DPO "
                                     f"record needs {a.prompt_key!r}, {a.chosen_key!r} and {a.rejected_key!r}): "
                                     f"{str(rec)[:80]}")
        return list(prompts)

    def _responses(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded response tokens, each ending with EOS, and their mask."""
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                for t in texts]
        for t, r in zip(texts, rows, strict=True):
            if len(r) > self.args.max_response_tokens:
                raise ValueError(f"{self.name}: response of {len(r)} tokens exceeds max_response_tokens="
                                 f"{self.args.max_response_tokens}: {t[:60]!r}")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width))
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1.0
        return ids, mask

    def collate_fn(self, items):
        a = self.args
        enc = self.tokenizer([it[a.prompt_key] for it in items], padding=True, return_tensors="pt")
        chosen_ids, chosen_mask = self._responses([it[a.chosen_key] for it in items])
        rejected_ids, rejected_mask = self._responses([it[a.rejected_key] for it in items])
        batch = {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
                 "response_ids": chosen_ids, "response_mask": chosen_mask,
                 "rejected_ids": rejected_ids, "rejected_mask": rejected_mask}
        for field in items[0]:
            batch[field] = [it.get(field) for it in items]
        return batch

    @torch.no_grad()
    def forward_step(self, data, iteration):
        chosen, rejected = pair_logprobs(self.model, data, self.device, self.args.temperature, self.packing,
                                         self.packing_budget)
        return {**data, "ref_logprobs": chosen.cpu(), "rejected_ref_logprobs": rejected.cpu()}

    def eval_step(self, data):
        return self.forward_step(data, 0)


class DPOArgs(OptimArgs):
    dpo_weight: float = Field(0.1, gt=0, description="beta: inverse temperature of the implicit reward")
    label_smoothing: float = Field(0.0, ge=0, le=0.5, description="cDPO: probability a preference label is flipped")
    use_ipo: bool = Field(False, description="IPO's squared loss instead of the sigmoid")


class DPOPolicyTrainer(CausalLMTrainer):
    """ppo_policy of the DPO engine: sigmoid/IPO loss on (chosen - rejected) log-ratios against the reference.

    The step's loss is the mean over the global batch's pairs (``sequence-mean``: a pair is one sequence). Its
    `eval_step` scores held-out pairs: ``scores`` is the implicit reward margin beta * ((pc - pr) - (rc - rr))
    and ``preferred`` whether it is > 0.
    """

    args_schema = DPOArgs
    aggregation = "sequence-mean"
    supports_pipeline = False  # two forward passes per micro-batch (chosen, rejected)

    def packed_views(self, mb: dict) -> list[dict]:
        return [mb, rejected_view(mb)]

    def _sequence_logprobs(self, batch: dict, budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = pair_logprobs(self.fwd, batch, self.device, self.args.temperature, self.packing, budget,
                                         self.model)
        return (sequence_logprob(chosen, batch["response_mask"].to(self.device)),
                sequence_logprob(rejected, batch["rejected_mask"].to(self.device)))

    def _ref(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = sequence_logprob(batch["ref_logprobs"], batch["response_mask"]).to(self.device)
        rejected = sequence_logprob(batch["rejected_ref_logprobs"], batch["rejected_mask"]).to(self.device)
        return chosen, rejected

    def stat_keys(self) -> tuple[str, ...]:
        return ("dpo_loss", "reward_accuracy", "reward_margin")

    def forward(self, mb: dict) -> Any:
        return self._sequence_logprobs(mb)

    def loss(self, mb: dict, out: Any, on: float, w: float) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.args
        pc, pr = out
        rc, rr = self._ref(mb)
        loss, st = dpo_loss(pc, pr, rc, rr, beta=a.dpo_weight, label_smoothing=a.label_smoothing, ipo=a.use_ipo)
        return loss * w, {"dpo_loss": float(loss.detach()) * w, "reward_accuracy": st["reward_accuracy"] * w,
                          "reward_margin": st["reward_margin"] * w}

    @torch.no_grad()
    def eval_step(self, data):
        pc, pr = self._sequence_logprobs(data, self.packing_budget)
        rc, rr = self._ref(data)
        margin = (self.args.dpo_weight * ((pc - pr) - (rc - rr))).cpu()
        return {"scores": margin, "preferred": (margin > 0).float()}


class OnlineDPOArgs(OptimArgs):
    dpo_weight: float = Field(0.1, gt=0, description="beta: inverse temperature of the implicit reward")
    use_ipo: bool = Field(False, description="IPO's squared loss instead of the sigmoid")


def pairs_in_groups(scores: torch.Tensor, group_ids: list[int]) -> list[tuple[int, int]]:
    """Every (i, j) of one prompt group with scores[i] > scores[j] (ties give no pair), as batch indices.

    Each group is compared only with itself, from its own members' positions, so a group without ordered
    pairs shifts nothing (ChatLearn v1.0.2 advanced its slice offset only for groups that had pairs)."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(int(g), []).append(i)
    values = scores.tolist()
    return [(i, j) for m in members.values() for i in m for j in m if values[i] > values[j]]


class OnlineDPOPolicyTrainer(CausalLMTrainer):
    """ppo_policy of the online DPO engine: pairs from each prompt group's reward order, scored by the
    length-normalised (policy - reference) log-prob of each response (log-probs clamped to <= 0, as ChatLearn).

    The step's loss is the mean over all pairs of the global batch (each micro-batch weighted by its pairs)."""

    args_schema = OnlineDPOArgs
    # it learns from pairs, not advantages; the reward's group advantages and reported KL are GRPO's
    default_advantage_estimator = "grpo"
    trains_on_groups = True
    pairs_in_groups = True
    supports_pipeline = False  # a micro-batch without pairs runs no forward pass
    supports_packing = False  # its pairs live inside each micro-batch's prompt groups, which a token cut would split

    def global_batch(self, data_list: list[dict]) -> GlobalMean:
        # the unit is a pair, found in each micro-batch's groups (online DPO's micro-batches hold whole groups)
        self._pairs = [pairs_in_groups(mb["scores"], mb["group_id"]) for mb in data_list]
        return global_mean([float(len(p)) for p in self._pairs])

    def stat_keys(self) -> tuple[str, ...]:
        return ("dpo_loss", "pair_accuracy", "margin")

    def step_stats(self, mean: GlobalMean) -> dict[str, float]:
        return {"num_pairs": mean.count}

    def skip_step(self, mean: GlobalMean) -> bool:
        return not mean.count

    def micro_batch(self, i: int, mb: dict, on: float, w: float) -> tuple[torch.Tensor | None, dict[str, float]]:
        a = self.args
        mb_pairs = self._pairs[i]
        if not mb_pairs:
            if self.parallel is None:
                return None, {}  # no ordered pair (all rewards tied): no signal, as ChatLearn skips such groups
            mb_pairs, w = [(0, 0)], 0.0  # every rank runs its passes (collectives); this one adds nothing
        mask = mb["response_mask"].to(self.device)
        lp = response_logprobs(self.fwd, mb, self.device, a.temperature).clamp(max=0)
        ref = mb["ref_logprobs"].to(self.device).clamp(max=0)
        s = sequence_logprob(lp, mask, length_normalize=True) - sequence_logprob(ref, mask, length_normalize=True)
        loss, st = online_dpo_loss(s, mb_pairs, beta=a.dpo_weight, ipo=a.use_ipo)
        return loss * w, {"dpo_loss": float(loss.detach()) * w, "pair_accuracy": st["pair_accuracy"] * w,
                          "margin": st["margin"] * w}
