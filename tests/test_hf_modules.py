"""The built-in modules in-process (no Ray): generation, log-prob consistency, training steps, rewards."""

import copy

import pytest
import torch

from chatlearn.models.hf.policy import PolicyInference, response_mask_to_stop
from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer, PPOValueTrainer
from chatlearn.models.hf.reference import ReferenceModel
from chatlearn.models.hf.reward import RuleReward
from chatlearn.models.hf.value import ValueModel
from chatlearn.tasks.max_digit import make_records, max_digit_reward
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig
from chatlearn.utils.imports import import_object


def bound(cls, name, args, trainable=False):
    mod = cls(name)
    mod.bind(ModelConfig(num_cpu=1, trainable=trainable, args_dict=args), RuntimeConfig(), 0, seed=7)
    mod.setup()
    return mod


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    policy = bound(PolicyInference, "policy", {"model_path": tiny_model_dir, "max_new_tokens": 4})
    prompts = make_records(6, seed=0)
    ds = policy.build_dataset(prompts)
    batch = policy.collate_fn(ds)
    return policy, policy.forward_step(batch, iteration=3)


def test_response_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert response_mask_to_stop(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_generation_is_seeded_by_iteration(rollout):
    policy, out = rollout
    batch = {k: v for k, v in out.items() if k in ("prompt_ids", "prompt_mask", "prompt", "answer")}
    again = policy.forward_step(batch, iteration=3)
    other = policy.forward_step(batch, iteration=4)
    assert torch.equal(again["response_ids"], out["response_ids"])
    assert not torch.equal(other["response_ids"], out["response_ids"])
    assert out["response_ids"].shape == (6, out["response_mask"].shape[1])
    assert out["logprobs"].shape == out["response_mask"].shape
    assert (out["logprobs"][out["response_mask"] == 0] == 0).all()
    assert (out["logprobs"][out["response_mask"] == 1] < 0).all()


def test_reference_and_trainer_logprobs_match_the_sampler_before_training(rollout, tiny_model_dir):
    # ratio == 1 on the first PPO step needs the trainer and reference to score exactly like the sampler
    _, out = rollout
    ref = bound(ReferenceModel, "reference", {"model_path": tiny_model_dir})
    assert torch.allclose(ref.forward_step(out, 0)["ref_logprobs"], out["logprobs"], atol=1e-5)
    trainer = bound(PPOPolicyTrainer, "ppo_policy", {"model_path": tiny_model_dir}, trainable=True)
    from chatlearn.models.hf.common import response_logprobs

    with torch.no_grad():
        lp = response_logprobs(trainer.model, out, trainer.device)
    assert torch.allclose(lp, out["logprobs"], atol=1e-5)


def experience(out, tiny_model_dir):
    value = bound(ValueModel, "value", {"model_path": tiny_model_dir})
    # a reward alone, outside an engine: no trainer tells it its estimator, so it names PPO's
    reward = bound(RuleReward, "reward", {"reward_fn": "chatlearn.tasks.max_digit:max_digit_reward",
                                          "kl_coef": 0.1, "advantage_estimator": "gae"})
    data = dict(out, ref_logprobs=out["logprobs"] - 0.1, values=value.forward_step(out, 0)["values"])
    return {**data, **reward.forward_step(data, 0)}


def test_reward_builds_ppo_experience(rollout, tiny_model_dir):
    _, out = rollout
    exp = experience(out, tiny_model_dir)
    expected = [max_digit_reward({"response": r, "answer": a}) for r, a in zip(out["response"], out["answer"])]
    assert exp["scores"].tolist() == pytest.approx(expected)
    mask = out["response_mask"]
    # kl = logprobs - ref_logprobs = 0.1 on every valid token
    assert torch.allclose(exp["kl"][mask == 1], torch.full_like(exp["kl"][mask == 1], 0.1))
    last = mask.sum(-1).long() - 1
    rows = torch.arange(len(last))
    assert torch.allclose(exp["rewards"][rows, last], exp["scores"] - 0.1 * 0.1)
    assert torch.allclose(exp["returns"], (exp["advantages"] + exp["values"]) * mask, atol=1e-6)


def ragged_split(out, tiny_model_dir):
    """The rollout's experience as one batch of 6 and as micro-batches of 2 + 4 responses of 3 + 15 tokens
    (ragged responses): token shares (1/6, 5/6) differ from sequence shares and from a mean of the means."""
    from chatlearn.data.batch import collate_samples, split_batch

    samples = split_batch(experience(out, tiny_model_dir))
    for sample, length in zip(samples, [1, 2, 4, 4, 3, 4], strict=True):
        sample["response_mask"] = sample["response_mask"].clone()
        sample["response_mask"][length:] = 0
    return [collate_samples(samples)], [collate_samples(samples[:2]), collate_samples(samples[2:])]


@pytest.mark.parametrize(("cls", "name", "keys"), [
    (PPOPolicyTrainer, "ppo_policy", ("policy_loss", "clipfrac", "approx_kl", "policy_grad_norm")),
    (PPOValueTrainer, "ppo_value", ("value_loss", "vf_clipfrac", "value_grad_norm"))])
def test_gradient_accumulation_equals_one_big_batch(rollout, tiny_model_dir, cls, name, keys):
    """The policy and value trainers run the same trainer loop: the micro-batches' step is the whole batch's
    (statistics and weights), each micro-batch weighted by its share of the response tokens."""
    _, out = rollout
    whole, parts = ragged_split(out, tiny_model_dir)
    a = bound(cls, name, {"model_path": tiny_model_dir}, trainable=True)
    b = bound(cls, name, {"model_path": tiny_model_dir}, trainable=True)
    sa = a.train_step(copy.deepcopy(whole), 0)
    sb = b.train_step(copy.deepcopy(parts), 0)
    assert sa[keys[0]] != 0 and sa[keys[-1]] > 0
    for key in keys:
        assert sa[key] == pytest.approx(sb[key], abs=1e-5, rel=1e-5), key
    for (n, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-5), n
    init = bound(cls, name, {"model_path": tiny_model_dir}, trainable=True)
    assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), init.model.parameters()))


def test_value_and_trainer_start_identical_and_sync(tiny_model_dir):
    value = bound(ValueModel, "value", {"model_path": tiny_model_dir})
    trainer = bound(PPOValueTrainer, "ppo_value", {"model_path": tiny_model_dir}, trainable=True)
    for (n, p), q in zip(value.model.state_dict().items(), trainer.model.state_dict().values()):
        assert torch.equal(p, q), n
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.5)
    value.set_weights(trainer.get_weights())
    assert all(torch.equal(p, q) for p, q in zip(value.model.parameters(), trainer.model.parameters()))
    with pytest.raises(RuntimeError, match="sync mismatch"):
        value.set_weights({"nope": torch.zeros(1)})


def test_checkpoint_round_trip(tmp_path, tiny_model_dir):
    rt = RuntimeConfig(output_dir=str(tmp_path), exp_name="ck")
    t = PPOPolicyTrainer("ppo_policy")
    t.bind(ModelConfig(num_cpu=1, trainable=True, args_dict={"model_path": tiny_model_dir}), rt, 0, seed=1)
    t.setup()
    path = t.save_checkpoint(5)
    assert path.endswith("iter_0000005")
    assert not (tmp_path / "ck" / "checkpoints" / "ppo_policy" / "iter_0000005.tmp").exists()
    saved = {k: v.clone() for k, v in t.model.state_dict().items()}
    with torch.no_grad():
        for p in t.model.parameters():
            p.zero_()
    t.load_checkpoint(5)
    assert all(torch.equal(saved[k], v) for k, v in t.model.state_dict().items())


def test_max_digit_reward_rule():
    assert max_digit_reward({"response": "7", "answer": "7"}) == 1.0
    assert max_digit_reward({"response": "72", "answer": "7"}) == 1.0
    assert max_digit_reward({"response": "5", "answer": "7"}) == pytest.approx(0.5 * (1 - 2 / 9))
    assert max_digit_reward({"response": "0x", "answer": "9"}) == 0.0
    assert max_digit_reward({"response": "x7", "answer": "7"}) == 0.0
    assert max_digit_reward({"response": "", "answer": "7"}) == 0.0


def test_import_object_errors_are_clear():
    assert import_object("chatlearn.tasks.max_digit:max_digit_reward") is max_digit_reward
    with pytest.raises(ValueError, match="not of the form"):
        import_object("nocolon")
    with pytest.raises(ValueError, match="has no attribute"):
        import_object("chatlearn.tasks.max_digit:nope")


def test_per_sample_sampler_draws_from_the_softmax():
    from chatlearn.models.hf.policy import PerSampleSampler

    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    n = 4000
    sampler = PerSampleSampler(seed=3, sample_ids=list(range(n)), temperature=1.0, top_k=0, top_p=1.0)
    picks = sampler(torch.zeros(n, 5, dtype=torch.long), logits.expand(n, 3)).argmax(-1)
    freq = torch.bincount(picks, minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)
    # top_k=1 is greedy; top_p=0.5 keeps only the most likely token
    for k, p in [(1, 1.0), (0, 0.5)]:
        s = PerSampleSampler(seed=3, sample_ids=list(range(50)), temperature=1.0, top_k=k, top_p=p)
        assert (s(torch.zeros(50, 5, dtype=torch.long), logits.expand(50, 3)).argmax(-1) == 0).all()


def test_responses_do_not_depend_on_the_generation_batching(tiny_model_dir):
    policy = bound(PolicyInference, "policy", {"model_path": tiny_model_dir, "max_new_tokens": 4})
    items = policy.build_dataset(make_records(6, seed=5))

    def gen(chunks):
        outs = []
        for chunk in chunks:
            batch = policy.collate_fn([items[i] for i in chunk])
            batch["sample_id"] = [100 + i for i in chunk]
            outs.append(policy.forward_step(batch, iteration=0))
        return [t for o in outs for t in o["response"]], torch.cat([o["logprobs"].sum(-1) for o in outs])

    whole_texts, whole_lp = gen([range(6)])
    split_texts, split_lp = gen([range(4), range(4, 6)])
    assert whole_texts == split_texts
    assert torch.allclose(whole_lp, split_lp, atol=1e-5)
    # one prompt per batch: no padding at all, while the whole batch pads its shorter prompts
    assert len({len(items[i]["prompt"]) for i in range(6)}) > 1
    alone_texts, alone_lp = gen([[i] for i in range(6)])
    assert alone_texts == whole_texts
    assert torch.allclose(alone_lp, whole_lp, atol=1e-5)
    other_texts, _ = gen([range(6)])
    assert other_texts == whole_texts  # and the same ids give the same draws again


def test_min_new_tokens_keeps_eos_out_until_then(tiny_model_dir):
    # a head that always prefers EOS: without min_new_tokens every response would be EOS at once
    policy = bound(PolicyInference, "policy", {"model_path": tiny_model_dir, "max_new_tokens": 5,
                                               "min_new_tokens": 3})
    eos = policy.tokenizer.eos_token_id
    head = torch.nn.Linear(policy.model.config.hidden_size, policy.model.config.vocab_size, bias=True)
    torch.nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.zero_()
        head.bias[eos] = 10.0
    policy.model.lm_head = head
    batch = policy.collate_fn(policy.build_dataset(make_records(4, seed=1)))
    batch["sample_id"] = [0, 1, 2, 3]
    out = policy.forward_step(batch, iteration=0)
    assert (out["response_ids"][:, :3] != eos).all() and (out["response_ids"][:, 3] == eos).all()
    assert out["response_mask"].sum(-1).tolist() == [4.0] * 4  # three tokens and the EOS
    # the pipeline path's own loop (greedy here) keeps EOS out just the same
    ids = policy._generate_in_stages(batch["prompt_ids"], batch["prompt_mask"], max_new_tokens=5,
                                     pad_token_id=policy.tokenizer.pad_token_id, eos_token_id=eos,
                                     min_new_tokens=3)[:, batch["prompt_ids"].shape[1]:]
    assert (ids[:, :3] != eos).all() and (ids[:, 3] == eos).all()
    policy.args.min_new_tokens = 0
    assert (policy.forward_step(batch, iteration=0)["response_ids"][:, 0] == eos).all()


@pytest.mark.parametrize("args", [{"max_new_tokens": 6}, {"max_new_tokens": 5, "min_new_tokens": 3,
                                                         "temperature": 0.7, "top_k": 5}])
def test_the_samplers_logprobs_are_the_forward_pass_logprobs(tiny_model_dir, args):
    """Generation keeps the drawn tokens' log-probs as it samples; they are what a forward pass over the
    responses gives (the reference's and the trainer's view), with no top-k and no EOS ban in them."""
    from chatlearn.models.hf.common import response_logprobs

    policy = bound(PolicyInference, "policy", {"model_path": tiny_model_dir, **args})
    batch = policy.collate_fn(policy.build_dataset(make_records(8, seed=2)))
    batch["sample_id"] = list(range(40, 48))
    out = policy.forward_step(batch, iteration=1)
    assert out["logprobs"].shape == out["response_mask"].shape
    with torch.no_grad():
        full = response_logprobs(policy.model, out, policy.device, policy.args.temperature)
    assert torch.allclose(out["logprobs"], full, atol=1e-5)
    assert (out["logprobs"][out["response_mask"] == 0] == 0).all()
    if args.get("min_new_tokens"):  # the ban held, yet no banned step's log-prob was renormalised without EOS
        assert (out["response_ids"][:, :3] != policy.tokenizer.eos_token_id).all()


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_the_lm_head_runs_on_the_response_positions_only_with_the_same_logits_and_gradients(model, request):
    """`response_logits` asks the model for the response positions only (``logits_to_keep``): the same
    values (bit for bit), and the same weight gradients through them, as slicing the full sequence's logits;
    the untied Llama and the Qwen2 whose LM head is its embedding alike."""
    from chatlearn.models.hf.common import full_sequence, load_causal_lm, response_logits, response_span

    path = request.getfixturevalue(model)
    policy = bound(PolicyInference, "policy", {"model_path": path, "max_new_tokens": 5})
    batch = policy.collate_fn(policy.build_dataset(make_records(6, seed=4)))
    batch["sample_id"] = list(range(6))
    out = policy.forward_step(batch, iteration=0)
    lm = load_causal_lm(path)
    ids, attn, pos = full_sequence(out)
    full = lm(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, response_span(out), :]
    weights = torch.randn(full.shape, generator=torch.Generator().manual_seed(0))
    (full * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    kept = response_logits(lm, out, torch.device("cpu"))
    (kept * weights).sum().backward()
    assert kept.shape == full.shape == (6, out["response_ids"].shape[1], lm.config.vocab_size)
    assert torch.equal(kept, full)
    for name, p in lm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-5, rtol=1e-4, msg=name)
