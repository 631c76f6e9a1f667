"""Padding-free (packed) training, issue 25 item 3: packed and padded forwards give the same log-probs, entropies
and values (1e-5, fp32) and the same step's gradients (1e-5 relative) for the GRPO, PPO policy, PPO value and DPO
trainers, on the tiny Llama and the tied-embedding GQA Qwen2, with micro-batches re-cut by a token budget; the
scoring modules pack in budget-sized forwards; the config refuses packing where it cannot run. The layouts
(DDP, FSDP2, TP, PP) are in tests/test_parallel.py."""

import pytest
import torch

from chatlearn.config import ConfigError, load_config
from chatlearn.config.engine_checks import EngineChecks
from chatlearn.data.batch import collate_samples, split_batch
from chatlearn.models.hf.common import load_causal_lm, response_tokens
from chatlearn.models.hf.dpo import DPOPolicyTrainer, PairReference
from chatlearn.models.hf.grpo_trainer import GRPOPolicyTrainer
from chatlearn.models.hf.packing import pack, regroup, token_budget_groups, use_packed_attention
from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer, PPOValueTrainer
from chatlearn.models.hf.reference import ReferenceModel
from chatlearn.models.hf.value import ValueModel
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig

DEFAULT = "configs/default.yaml"


def ragged(n: int, seed: int, p: int = 6, r: int = 9, rejected: bool = False) -> dict:
    """A batch of ``n`` samples with prompts of 1..p tokens (left-padded) and responses of 1..r (right-padded),
    and what every trainer reads ([B, R] log-probs, advantages, values, returns; a DPO pair's rejected side)."""
    g = torch.Generator().manual_seed(seed)

    def side(width: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width)
        for i in range(n):
            k = int(torch.randint(1, width + 1, (1,), generator=g))
            cols = slice(width - k, width) if left else slice(0, k)
            ids[i, cols] = torch.randint(4, 30, (k,), generator=g)
            mask[i, cols] = 1.0
        return ids, mask

    prompt_ids, prompt_mask = side(p, True)
    response_ids, response_mask = side(r, False)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
             "response_mask": response_mask}
    for key, scale in (("logprobs", -3.0), ("ref_logprobs", -3.0), ("advantages", 1.0), ("values", 1.0),
                       ("returns", 1.0)):
        base = torch.rand(n, r, generator=g) if scale < 0 else torch.randn(n, r, generator=g)
        batch[key] = base * abs(scale) * (-1 if scale < 0 else 1) * response_mask
    if rejected:
        batch["rejected_ids"], batch["rejected_mask"] = side(r, False)
        batch["rejected_ref_logprobs"] = -torch.rand(n, r, generator=g) * 3 * batch["rejected_mask"]
    return batch


def micro_batches(seed: int = 0, rejected: bool = False) -> list[dict]:
    """Three micro-batches of 3, 2 and 4 samples of different widths (as the runtime cuts an episode)."""
    return [ragged(3, seed, rejected=rejected), ragged(2, seed + 1, p=4, r=5, rejected=rejected),
            ragged(4, seed + 2, p=7, r=11, rejected=rejected)]


def bound(cls, path: str, packing: bool, budget: int = 32768, trainable: bool = True, **args):
    module = cls("ppo_policy")
    module.bind(ModelConfig(num_cpu=1, trainable=trainable, packing=packing, max_token_in_packing=budget,
                            args_dict={"model_path": path, "max_grad_norm": 1e9, **args}), RuntimeConfig(), 0, seed=7)
    module.setup()
    return module


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_qwen2_dir


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert got.shape == want.shape
    worst = float((got - want).detach().abs().max())
    assert worst <= tol, f"differ by {worst}"


# -- the packing itself -------------------------------------------------------------------------------------------

def test_pack_keeps_the_real_tokens_their_positions_and_the_predicting_positions():
    batch = {"prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
             "response_ids": torch.tensor([[10, 11, 0], [12, 0, 0]]),
             "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])}
    p = pack([batch])
    assert p.input_ids.tolist() == [[5, 6, 10, 11, 7, 8, 9, 12]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert p.keep.tolist() == [1, 2, 6] and p.labels.tolist() == [10, 11, 12]
    (back,) = p.unpack(torch.tensor([1.0, 2.0, 3.0]))
    assert back.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]
    two = pack([batch, batch])  # a second view continues the row; each view gets its own values back
    assert two.keep.tolist() == [1, 2, 6, 9, 10, 14]
    assert [t.tolist() for t in two.unpack(torch.arange(6.0))] == [[[0, 1, 0], [2, 0, 0]], [[3, 4, 0], [5, 0, 0]]]
    with pytest.raises(ValueError, match="follows padding"):
        pack([{**batch, "prompt_mask": torch.tensor([[0, 0, 0], [1, 1, 1]])}])


def test_token_budget_groups_fill_in_order_and_a_long_sample_runs_alone():
    assert token_budget_groups([3, 4, 2, 9, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert token_budget_groups([3, 4, 2, 9, 1, 1], 100) == [[0, 1, 2, 3, 4, 5]]
    assert token_budget_groups([], 8) == []


def test_regroup_keeps_every_sample_in_order_within_the_budget():
    data = micro_batches()
    cut = regroup(data, 40)
    assert len(cut) > 1
    samples = [s for mb in data for s in split_batch(mb)]
    again = [s for mb in cut for s in split_batch(mb)]
    assert len(again) == len(samples)
    for a, b in zip(samples, again):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for mb in cut:
        assert len(mb["prompt_ids"]) == 1 or float(mb["prompt_mask"].sum() + mb["response_mask"].sum()) <= 40
    assert all(torch.equal(a[k], b[k]) for a, b in zip(cut, regroup(data, 40)) for k in a)  # deterministic


# -- forwards -------------------------------------------------------------------------------------------------------

def test_packed_log_probs_and_entropies_equal_the_padded_ones(model_dir):
    model = load_causal_lm(model_dir)
    use_packed_attention(model)  # the padded path of a packing model stays SDPA's, exactly
    batch = collate_samples([s for mb in micro_batches() for s in split_batch(mb)])
    cpu = torch.device("cpu")
    padded = response_tokens(model, batch, cpu, 0.7, entropy=True)
    packed = response_tokens(model, batch, cpu, 0.7, entropy=True, packed=True)
    chunked = response_tokens(model, batch, cpu, 0.7, entropy=True, packed=True, budget=30)
    for got in (packed, chunked):
        close(got.logprobs, padded.logprobs)
        close(got.entropy, padded.entropy)
    assert float(padded.logprobs[batch["response_mask"] == 0].abs().max()) == 0.0
    assert float(packed.logprobs[batch["response_mask"] == 0].abs().max()) == 0.0


def test_scoring_modules_pack_in_budget_sized_forwards(model_dir):
    batch = collate_samples([s for mb in micro_batches(rejected=True) for s in split_batch(mb)])
    for cls, keys in ((ReferenceModel, ["ref_logprobs"]), (ValueModel, ["values"]),
                      (PairReference, ["ref_logprobs", "rejected_ref_logprobs"])):
        padded, packed = (bound(cls, model_dir, p, budget=25, trainable=False).forward_step(dict(batch), 0)
                          for p in (False, True))
        for key in keys:
            close(packed[key], padded[key])


# -- the step -------------------------------------------------------------------------------------------------------

TRAINERS = {
    "grpo": (GRPOPolicyTrainer, {"kl_coef": 0.1, "entropy_coef": 0.01, "temperature": 0.8}),
    "ppo": (PPOPolicyTrainer, {}),
    "value": (PPOValueTrainer, {}),
    "dpo": (DPOPolicyTrainer, {}),
}


def step(kind: str, path: str, packing: bool, budget: int = 32768) -> tuple[dict, dict]:
    cls, args = TRAINERS[kind]
    module = bound(cls, path, packing, budget, **args)
    module.optimizer.step = lambda: None  # keep the weights: compare the accumulated gradients
    stats = module.train_step(micro_batches(rejected=kind == "dpo"), 0)
    return stats, {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", list(TRAINERS))
def test_the_packed_step_has_the_padded_steps_gradient(model_dir, kind):
    """Packed, in token-budget micro-batches cut elsewhere than the padded ones (40 tokens: five or more of
    them), the step's loss, statistics and gradient are the padded step's."""
    want_stats, want = step(kind, model_dir, False)
    got_stats, got = step(kind, model_dir, True, budget=40)
    assert got.keys() == want.keys()
    scale = max(float(g.abs().max()) for g in want.values())
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert worst <= 1e-5 * scale, f"{kind}: gradients differ by {worst} (largest {scale})"
    for key, value in want_stats.items():
        assert got_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_lora_adapters_train_packed_as_padded(tiny_model_dir):
    grads = []
    for packing in (False, True):
        module = GRPOPolicyTrainer("ppo_policy")
        module.bind(ModelConfig(num_cpu=1, trainable=True, packing=packing, max_token_in_packing=40,
                                lora={"enable_lora": True, "lora_dim": 4},
                                args_dict={"model_path": tiny_model_dir, "max_grad_norm": 1e9}), RuntimeConfig(), 0,
                    seed=7)
        module.setup()
        module.optimizer.step = lambda: None
        module.train_step(micro_batches(), 0)
        grads.append({n: p.grad for n, p in module.model.named_parameters() if p.grad is not None})
    scale = max(float(g.abs().max()) for g in grads[0].values())
    assert grads[0].keys() == grads[1].keys() and scale > 0
    assert max(float((grads[1][n] - grads[0][n]).abs().max()) for n in grads[0]) <= 1e-5 * scale


def test_the_packed_step_is_deterministic(tiny_qwen2_dir):
    first, second = (step("grpo", tiny_qwen2_dir, True, budget=40)[1] for _ in range(2))
    assert all(torch.equal(first[n], second[n]) for n in first)


# -- the config -------------------------------------------------------------------------------------------------

def problems(*overrides: str, config: str = DEFAULT) -> list[str]:
    try:
        load_config(config, list(overrides), [EngineChecks()])
        return []
    except ConfigError as exc:
        return exc.problems


def test_packing_fields_are_real_and_checked():
    m = ModelConfig(num_cpu=1)
    assert (m.packing, m.max_token_in_packing) == (False, 32768) and not m.model_extra
    assert problems("models.reference.packing=true", "models.value.packing=true", "models.ppo_policy.packing=true",
                    "models.ppo_value.packing=true", "models.ppo_policy.max_token_in_packing=4096") == []
    assert problems("models.reference.packing=true", "models.reference.num_cpu=2",  # pipeline stages pack too
                    "models.reference.pipeline_model_parallel_size=2") == []
    assert problems("models.ppo_policy.max_token_in_packing=0") == [
        "models.ppo_policy.max_token_in_packing: must be >= 1, got 0"]


@pytest.mark.parametrize(("overrides", "config", "names"), [
    (["models.reward.packing=true"], DEFAULT, "RuleReward"),
    (["models.policy.packing=true"], DEFAULT, "PolicyInference"),
    (["models.ppo_policy.packing=true"], "configs/online_dpo.yaml", "OnlineDPOPolicyTrainer"),
])
def test_a_model_or_layout_that_cannot_pack_refuses_packing(overrides, config, names):
    found = [p for p in problems(*overrides, config=config) if ".packing:" in p]
    assert len(found) == 1 and "is not supported yet" in found[0] and names in found[0], found
