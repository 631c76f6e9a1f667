"""Multi-turn rollouts (runtime.task_type: agent) without Ray: the conversation the trainer gets is, token for
token, what the policy generated plus what the environment returned; the observations stay out of the loss;
the sampler's log-probs are those of the whole conversation read at once; the config checks."""

import pytest
import torch

from chatlearn.algorithms.aggregation import units
from chatlearn.config import ConfigError, EngineChecks, load_config
from chatlearn.data.batch import collate_samples, loss_mask, split_batch
from chatlearn.envs.render import ObservationRenderer
from chatlearn.envs.turns import TurnSpec, env_seed, step_conversations
from chatlearn.models.hf.common import response_logprobs
from chatlearn.models.hf.policy import PolicyInference
from chatlearn.runtime.cluster.host import ModelHost
from chatlearn.tasks.max_digit import make_records
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig
from chatlearn.utils.errors import RunError
from tests.conftest import REPO


class CountingEnv:
    """Answers each turn with what it read (its length) and the turn; ends after ``turns`` answers, earlier
    for half the samples (by seed); the reward is the number of answers read, so it shows in the sum."""

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, sample):
        self.limit = self.turns - (sample["env_seed"] >> 1) % 2  # seeded from the sample
        return None

    def step(self, action):
        self.seen += 1
        done = self.seen >= self.limit
        return f"read {len(action)} chars, turn {self.seen}", 1.0, done, {"tool_calls": 1, "tool_errors": 0}


class RaisingEnv(CountingEnv):
    def step(self, action):
        if self.seen == 1:
            raise ValueError("the world broke")
        return super().step(action)


def _spec(env: str, max_turns: int = 4, max_total_tokens: int = 400, max_new_tokens: int = 8,
          model_path: str = "") -> TurnSpec:
    return TurnSpec(env=env, max_turns=max_turns, max_total_tokens=max_total_tokens, max_new_tokens=max_new_tokens,
                    seed=7, model_path=model_path)


def _host(model_dir: str, max_new_tokens: int) -> ModelHost:
    policy = PolicyInference("policy")
    host = ModelHost(policy, ModelConfig(num_cpu=1, args_dict={"model_path": model_dir, "max_new_tokens":
                                                                max_new_tokens}),
                     RuntimeConfig(), 0)
    policy.setup()  # the host's own setup reads Ray's worker context
    host.pad_token_id = policy.tokenizer.pad_token_id
    lift = torch.zeros(policy.model.config.vocab_size)  # EOS likely: answers end at many lengths
    lift[policy.tokenizer.eos_token_id] = 2.0
    policy.model.lm_head.register_forward_hook(lambda _m, _i, out: out + lift)
    host.build_dataset(make_records(4, seed=3))
    return host


def test_the_trained_conversation_is_what_the_policy_generated_plus_what_the_environment_returned(tiny_qwen2_dir):
    """Turn by turn on the tiny Qwen2 (ChatML template): each conversation's response is its answers, as the
    policy returned them, and the observations' tokens, as the renderer made them, in order; loss mask 1 exactly
    at the answers; the sampler's log-probs at the answers equal one forward pass over the whole conversation
    (1e-5), 0 at the observations; split and collated again (the trainer's micro-batches) nothing changes."""
    host = _host(tiny_qwen2_dir, 8)
    spec = _spec(f"{__name__}:CountingEnv", model_path=tiny_qwen2_dir)
    renderer = ObservationRenderer(host.module.tokenizer)
    ids = list(range(10, 18))
    batch = host.generate([i // 2 for i in range(8)], 0, sample_ids=ids, group_size=2)
    expected = {sid: [] for sid in ids}  # each sample's segments: ("answer", ids, logprobs) / ("obs", ids)
    for s in split_batch(batch):
        expected[s["sample_id"]].append(("answer", s["response_ids"].tolist(), s["logprobs"].tolist()))
    ended, envs, turn = [], None, 1
    while True:
        result = step_conversations(batch, envs, turn, spec, renderer)
        ended += result.ended
        for s in result.going:
            n = len(expected[s["sample_id"]])
            before = sum(len(seg[1]) for seg in expected[s["sample_id"]])
            obs = s["response_ids"][before:].tolist()
            answer = host.module.tokenizer.decode(expected[s["sample_id"]][n - 1][1], skip_special_tokens=True)
            assert obs == renderer.ids(f"read {len(answer)} chars, turn {turn}")
            expected[s["sample_id"]].append(("obs", obs))
        if not result.going:
            break
        turn += 1
        batch = host.generate([], 0, continued=result.going)
        for s in split_batch(batch):
            start = int(s["turn_start"])
            expected[s["sample_id"]].append(("answer", s["response_ids"][start:].tolist(),
                                             s["logprobs"][start:].tolist()))
        envs = result.envs
    assert turn == 3 and sorted(s["sample_id"] for s in ended) == ids
    turns = {s["sample_id"]: s["turns"] for s in ended}
    assert set(turns.values()) == {2, 3}  # the seeds' parity: some conversations ended a turn earlier
    trained = split_batch(collate_samples(sorted(ended, key=lambda s: s["sample_id"]), host.pad_token_id))
    for s in trained:
        segments = expected[s["sample_id"]]
        assert [kind for kind, *_ in segments] == ["answer", "obs"] * (turns[s["sample_id"]] - 1) + ["answer"]
        assert s["response_ids"].tolist() == [t for seg in segments for t in seg[1]]
        assert s["loss_mask"].tolist() == [float(kind == "answer") for kind, toks, *_ in segments for _ in toks]
        lps = [lp for seg in segments for lp in (seg[2] if seg[0] == "answer" else [0.0] * len(seg[1]))]
        assert torch.allclose(s["logprobs"], torch.tensor(lps), atol=0)
        assert s["env_reward"] == float(turns[s["sample_id"]]) and s["tool_calls"] == turns[s["sample_id"]]
    whole = collate_samples(trained, host.pad_token_id)
    forward = response_logprobs(host.module.model, whole, "cpu", 1.0)
    mask = loss_mask(whole).bool()
    assert torch.allclose(forward[mask], whole["logprobs"][mask], atol=1e-5)
    # the losses' normaliser counts the answers' tokens only
    assert units([whole], "token-mean")[0] == float(sum(mask.sum(-1)))
    assert units([whole], "token-mean")[0] < float(whole["response_mask"].sum())


def test_a_conversation_stops_at_max_turns_and_at_the_token_budget(tiny_qwen2_dir):
    host = _host(tiny_qwen2_dir, 8)
    renderer = ObservationRenderer(host.module.tokenizer)
    batch = host.generate([0, 1], 0, sample_ids=[0, 1])
    one = step_conversations(batch, None, 1, _spec(f"{__name__}:CountingEnv", max_turns=1), renderer)
    assert not one.going and [s["turns"] for s in one.ended] == [1, 1]
    # a budget that holds the first answer but not an observation and another whole answer
    lengths = [int(m.sum()) for m in batch["response_mask"]]
    tight = step_conversations(batch, None, 1, _spec(f"{__name__}:CountingEnv",
                                                     max_total_tokens=max(lengths) + 8), renderer)
    assert not tight.going and len(tight.ended) == 2
    assert [s["response_ids"].tolist() for s in tight.ended] == [s["response_ids"].tolist()
                                                                  for s in split_batch(batch)]


def test_an_environment_that_raises_is_one_error_naming_the_sample_the_turn_and_the_class(tiny_qwen2_dir):
    host = _host(tiny_qwen2_dir, 8)
    renderer = ObservationRenderer(host.module.tokenizer)
    spec = _spec(f"{__name__}:RaisingEnv")
    batch = host.generate([0, 1], 0, sample_ids=[4, 5])
    first = step_conversations(batch, None, 1, spec, renderer)
    assert len(first.going) == 2
    with pytest.raises(RunError, match=rf"environment {__name__}:RaisingEnv on sample 4, turn 2 raised ValueError: "
                                       "the world broke"):
        step_conversations(host.generate([], 0, continued=first.going), first.envs, 2, spec, renderer)


def test_environment_seeds_are_per_sample_and_apart_for_eval():
    seeds = {env_seed(42, sid, ev) for sid in range(100) for ev in (False, True)}
    assert len(seeds) == 200 and env_seed(42, 3, False) == env_seed(42, 3, False)


def problems(*overrides: str, config: str = "grpo") -> str:
    try:
        load_config(f"{REPO}/configs/{config}.yaml", list(overrides), [EngineChecks()])
    except ConfigError as exc:
        return "\n".join(exc.problems)
    return ""


def test_agent_config_checks_name_their_fields():
    env = f"runtime.agent.env={__name__}:CountingEnv"
    assert problems("runtime.task_type=agent", env) == ""
    assert "runtime.task_type" in problems("runtime.task_type=agents")
    assert "runtime.agent.max_turns: only used with runtime.task_type: agent" in problems("runtime.agent.max_turns=3")
    # every field given at its default, as a deployment's form sends them: nothing to remove
    assert problems("runtime.agent.max_turns=4", "runtime.agent.retries=0", "runtime.agent.env_args={}") == ""
    assert "runtime.agent.env: task_type: agent needs an environment class" in problems("runtime.task_type=agent")
    assert "runtime.agent.env: chatlearn.tasks.max_digit:make_records is not an environment class" in problems(
        "runtime.task_type=agent", "runtime.agent.env=chatlearn.tasks.max_digit:make_records")
    both = problems("runtime.task_type=agent", env, "runtime.use_partial_rollout=true",
                    "runtime.stream_data_loader_type=dynamic")
    assert "runtime.use_partial_rollout with runtime.task_type: agent is not supported yet" in both
    assert "runtime.agent.max_total_tokens: 1 is less than models.policy max_new_tokens (2)" in problems(
        "runtime.task_type=agent", env, "runtime.agent.max_total_tokens=1")
    assert "the 'dpo' engine has no policy-gradient trainer" in (
        problems("runtime.task_type=agent", env, config="dpo"))


def test_an_answer_cut_off_before_its_eos_is_closed_by_the_observation():
    """A templated tokenizer's observation follows an answer's EOS; an answer that ran out of tokens has none,
    so the observation brings it (loss mask 0): the conversation reads as the template renders it. An answer
    that ended keeps its own EOS and gets none more."""
    from chatlearn.models.hf.tiny import build_family_tokenizer

    tok = build_family_tokenizer("qwen2")
    renderer = ObservationRenderer(tok)
    words = tok("12", add_special_tokens=False)["input_ids"]
    ended = torch.tensor(words + [tok.eos_token_id])
    cut = torch.tensor(words)
    batch = collate_samples([
        {"prompt_ids": torch.tensor([5, 6]), "prompt_mask": torch.ones(2, dtype=torch.long), "response_ids": r,
         "response_mask": torch.ones(len(r)), "logprobs": torch.zeros(len(r)), "sample_id": sid}
        for sid, r in ((0, ended), (1, cut))], tok.pad_token_id)
    result = step_conversations(batch, None, 1, _spec(f"{__name__}:CountingEnv"), renderer)
    assert [s["sample_id"] for s in result.going] == [0, 1]
    obs = renderer.ids("read 2 chars, turn 1")
    first, second = result.going
    assert first["response_ids"].tolist() == ended.tolist() + obs
    assert second["response_ids"].tolist() == cut.tolist() + [tok.eos_token_id] + obs
    assert second["loss_mask"].tolist() == [1.0] * len(cut) + [0.0] * (1 + len(obs))
