"""Partial rollouts (runtime.use_partial_rollout): a response generated over several rounds is the response
generated at once, on unchanged weights, token for token; the buffer's rules (finished, waiting, released by
whole groups, in a fixed order), its checkpoint, ChatLearn's config checks and ours."""

import itertools

import pytest
import torch

from chatlearn.config import ConfigError, EngineChecks, load_config
from chatlearn.config.runtime import PartialRolloutConfig
from chatlearn.data.batch import split_batch
from chatlearn.data.partial_rollout import (
    PartialRollouts,
    RolloutBuffer,
    continuation_batches,
    release_batches,
    settle,
)
from chatlearn.data.staleness import drop_stale
from chatlearn.models.hf.policy import PolicyInference
from chatlearn.runtime.cluster.host import ModelHost
from chatlearn.tasks.max_digit import make_records
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig
from tests.conftest import REPO


def test_round_budgets_add_up_to_max_new_tokens():
    assert PartialRolloutConfig().round_budgets(16) == [8, 8]
    # ChatLearn's int() per round gives 4 + 11 = 15 of 16
    assert PartialRolloutConfig(max_rollout_round=2, rollout_ratio=[0.3, 0.7]).round_budgets(16) == [5, 11]
    # exact float equality (ChatLearn's check) refuses these; they sum to 1 within rounding
    assert PartialRolloutConfig(max_rollout_round=3, rollout_ratio=[0.1, 0.2, 0.7]).round_budgets(10) == [1, 2, 7]


def _policy_host(model_dir: str, engine: str, max_new_tokens: int) -> ModelHost:
    policy = PolicyInference("policy")
    host = ModelHost(policy, ModelConfig(num_cpu=1, args_dict={"model_path": model_dir, "max_new_tokens":
                                                                max_new_tokens, "max_num_seqs": 3}),
                     RuntimeConfig(rollout_engine=engine), 0)
    policy.setup()  # the host's own setup reads Ray's worker context
    host.pad_token_id = policy.tokenizer.pad_token_id
    # EOS made likely: responses end at many lengths, in every round
    lift = torch.zeros(policy.model.config.vocab_size)
    lift[policy.tokenizer.eos_token_id] = 2.5
    policy.model.lm_head.register_forward_hook(lambda _m, _i, out: out + lift)
    host.build_dataset(make_records(6, seed=4))
    return host


@pytest.mark.parametrize("engine", ["hf", "continuous"])
def test_a_response_continued_over_rounds_is_the_response_generated_at_once(engine, tiny_qwen2_dir):
    """Rounds of 4, 4 and 8 tokens on unchanged weights (the tiny Qwen2: tied embeddings, GQA): the finished
    responses, their log-probs and their texts are those of one generate of 16 tokens; each token carries the
    version of the round that drew it."""
    host = _policy_host(tiny_qwen2_dir, engine, 16)
    ids = list(range(100, 112))
    indices = [i // 2 for i in range(12)]
    whole = split_batch(host.generate(indices, 0, sample_ids=ids, group_size=2))
    budgets = PartialRolloutConfig(max_rollout_round=3, rollout_ratio=[0.25, 0.25, 0.5]).round_budgets(16)
    assert budgets == [4, 4, 8]
    buffer, released, rounds = RolloutBuffer(), [], []
    produced = split_batch(host.generate(indices, 0, sample_ids=ids, group_size=2, max_new_tokens=budgets[0],
                                         policy_version=0))
    for version in range(3):
        groups, buffer, counts = settle(buffer, produced, group_size=2, max_rounds=3)
        released += [s for g in groups for s in g]
        rounds.append(counts)
        batches = continuation_batches(buffer.unfinished, budgets, batch_size=5)
        produced = [s for budget, samples in batches for s in split_batch(
            host.generate([], 0, continued=samples, max_new_tokens=budget, policy_version=version + 1))]
    assert not produced and not buffer.unfinished and not buffer.waiting
    assert [r["round_0_samples"] for r in rounds] == [12, 0, 0]
    assert rounds[1]["round_1_samples"] > 0 and rounds[2]["round_2_samples"] > 0  # all three rounds ran
    assert rounds[0]["partial_released"] > 0  # some groups finished in the first round
    by_id = {s["sample_id"]: s for s in released}
    assert sorted(by_id) == ids
    lengths = set()
    for expected in whole:
        got = by_id[expected["sample_id"]]
        n = int(expected["response_mask"].sum())
        lengths.add(n)
        assert torch.equal(got["response_ids"], expected["response_ids"]), expected["sample_id"]
        assert got["response"] == expected["response"]
        torch.testing.assert_close(got["logprobs"], expected["logprobs"], atol=1e-5, rtol=0)
        spans = [min(n, 4), min(max(n - 4, 0), 4), max(n - 8, 0)]
        assert got["token_versions"].tolist() == [v for v, k in enumerate(spans) for _ in range(k)]
        assert got["policy_version"] == sum(1 for k in spans if k) - 1  # the round it finished in
    assert len(lengths) >= 3


def _sample(sid: int, rnd: int, finished: bool, group_size: int = 2, version: int = 0) -> dict:
    return {"sample_id": sid, "group_id": sid // group_size, "rollout_round": rnd, "rollout_finished": finished,
            "policy_version": version}


def test_settle_releases_whole_groups_in_order_and_keeps_the_rest():
    buffer = RolloutBuffer(waiting=[_sample(5, 1, True)])
    produced = [_sample(7, 1, True), _sample(1, 1, True), _sample(0, 1, True), _sample(4, 2, False),
                _sample(6, 1, False), _sample(3, 1, True)]
    groups, after, counts = settle(buffer, produced, group_size=2, max_rounds=2)
    # 4 used its last round: finished whatever its EOS
    assert [[s["sample_id"] for s in g] for g in groups] == [[0, 1], [4, 5]]
    assert [s["sample_id"] for s in after.waiting] == [3, 7]
    assert [s["sample_id"] for s in after.unfinished] == [6]
    assert counts == {"round_0_samples": 5.0, "round_1_samples": 1.0, "partial_released": 4.0,
                      "partial_unfinished": 1.0, "partial_waiting": 2.0, "partial_group_parts": 0.0}
    assert after.released == {}  # whole groups leave nothing to count
    assert [[s["sample_id"] for s in b] for b in release_batches(groups, 3)] == [[0, 1], [4, 5]]
    assert [[s["sample_id"] for s in b] for b in release_batches(groups, 4)] == [[0, 1, 4, 5]]


def test_mini_response_per_prompt_releases_a_group_in_parts_as_chatlearn_does():
    """Groups of 4, mini_response_per_prompt 1: a group's finished responses go once 2 of it are finished, each
    later one as it finishes; the counts of the groups released in part carry over (and through a checkpoint)."""
    def ids(groups):
        return [[s["sample_id"] for s in g] for g in groups]

    # group 0: 0 and 2 finish now (2 > 1: released); group 1: only 5 finishes (waits); group 2: all 4 finish
    produced = [_sample(i, 1, i in (0, 2, 5, 8, 9, 10, 11), group_size=4) for i in range(12)]
    groups, after, counts = settle(RolloutBuffer(), produced, group_size=4, max_rounds=3, mini_response=1)
    assert ids(groups) == [[0, 2], [8, 9, 10, 11]]
    assert [s["sample_id"] for s in after.waiting] == [5]
    assert after.released == {0: 2}  # group 2 is done: not counted any more
    assert counts["partial_released"] == 6.0 and counts["partial_group_parts"] == 1.0
    # a batch holds groups of one size: the whole group first, then the part
    assert ids(release_batches(groups, 8)) == [[8, 9, 10, 11], [0, 2]]
    # next episode: group 0's 1 finishes alone and goes at once (its group passed the mark); group 1's 4 and 6
    # finish, so with 5 waiting it passes the mark (3 > 1); 3 and 7 stay unfinished
    produced = [_sample(i, 2, i in (1, 4, 6), group_size=4) for i in (1, 3, 4, 6, 7)]
    groups, after2, counts = settle(after, produced, group_size=4, max_rounds=3, mini_response=1)
    assert ids(groups) == [[1], [4, 5, 6]]
    assert after2.released == {0: 3, 1: 3} and [s["sample_id"] for s in after2.unfinished] == [3, 7]
    assert ids(release_batches(groups, 8)) == [[4, 5, 6], [1]]
    # the default (group size - 1) is the whole-group rule: the same input waits
    whole, kept, _ = settle(RolloutBuffer(waiting=after.waiting), produced, group_size=4, max_rounds=3)
    assert ids(whole) == [] and [s["sample_id"] for s in kept.waiting] == [1, 4, 5, 6]


def test_the_trainer_moves_parts_of_groups_whole():
    """The stale-sample drop and the epoch shuffle cut by group id: a part of a group is one block, and where
    every group is whole they cut as blocks of group_size did."""
    from chatlearn.data.stream import group_blocks, training_batches

    parts = [_sample(i, 1, True, group_size=4, version=v) for i, v in ((0, 0), (1, 0), (4, 1), (5, 1), (6, 1), (2, 1))]
    assert [[s["sample_id"] for s in b] for b in group_blocks(parts, 4)] == [[0, 1], [4, 5, 6], [2]]
    kept, stats = drop_stale(parts, 2, max_staleness=1, group_size=4)
    assert [s["sample_id"] for s in kept] == [4, 5, 6, 2] and stats["dropped_stale"] == 2.0
    whole = [_sample(i, 1, True, group_size=2) for i in range(8)]
    assert group_blocks(whole, 2) == [whole[i:i + 2] for i in range(0, 8, 2)]
    blocks = [[0, 1], [4, 5, 6], [2]]
    orders = {tuple(i for b in perm for i in b) for perm in itertools.permutations(blocks)}
    for seed in range(4):  # the second epoch's order: the three parts shuffled, each whole
        second = [s["sample_id"] for mb in training_batches(parts, 6, 6, 2, seed, group_size=4)[1] for s in mb]
        assert tuple(second) in orders


def test_continuation_batches_go_by_round_then_sample_id():
    unfinished = [_sample(9, 1, False), _sample(2, 2, False), _sample(4, 1, False), _sample(1, 1, False)]
    batches = continuation_batches(unfinished, [4, 6, 6], batch_size=2)
    assert [(b, [s["sample_id"] for s in ss]) for b, ss in batches] == [(6, [1, 4]), (6, [9]), (6, [2])]


def test_the_driver_keeps_the_buffers_a_checkpoint_or_a_later_episode_needs():
    rollouts = PartialRollouts([2, 2], group_size=2, batch_size=4, keep=2)
    rollouts.start(3)
    assert rollouts.before(3) == RolloutBuffer()
    for episode in range(3, 7):
        rollouts.settle(episode, [_sample(2 * episode, 1, False), _sample(2 * episode + 1, 1, True)])
    assert sorted(rollouts._after) == [4, 5, 6]  # episode 4's checkpoint may come after episode 6's generation
    assert [s["sample_id"] for s in rollouts.after(6).unfinished] == [12]


def test_the_buffer_checkpoint_round_trips(tmp_path):
    sample = {"sample_id": 3, "group_id": 1, "rollout_round": 1, "rollout_finished": False, "prompt": "max 1 2 ?",
              "response_ids": torch.tensor([5, 6]), "logprobs": torch.tensor([-0.5, -1.25]),
              "token_versions": torch.tensor([2, 2]), "scores": torch.tensor(0.5)}
    RolloutBuffer([sample], [dict(sample, sample_id=4, rollout_finished=True)], {1: 5, 12: 2}).save(str(tmp_path), 7)
    back = RolloutBuffer.load(str(tmp_path))
    assert [s["sample_id"] for s in back.unfinished] == [3] and [s["sample_id"] for s in back.waiting] == [4]
    assert back.released == {1: 5, 12: 2}
    for key, value in sample.items():
        got = back.unfinished[0][key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value


def test_token_staleness_and_the_drop_bound_of_a_partial_rollout():
    def sample(versions):
        return {"policy_version": versions[-1], "token_versions": torch.tensor(versions),
                "response_mask": torch.ones(len(versions))}

    # trained at version 3: one response drawn on versions 2 then 3, one finished on 1 and waiting since
    kept, stats = drop_stale([sample([2, 2, 3]), sample([1, 1])], 3, max_staleness=0 + 2 - 1, group_size=1)
    assert len(kept) == 1 and stats["dropped_stale"] == 1.0
    assert stats["staleness_token_mean"] == pytest.approx((1 + 1 + 0 + 2 + 2) / 5)


def problems(*overrides: str, config: str = "grpo") -> list[str]:
    try:
        load_config(f"{REPO}/configs/{config}.yaml", ["runtime.use_partial_rollout=true", *overrides],
                    [EngineChecks()])
    except ConfigError as exc:
        return exc.problems
    return []


def test_chatlearn_checks_and_ours_name_the_field():
    dynamic = "runtime.stream_data_loader_type=dynamic"
    assert problems(dynamic) == []
    assert any("stream_data_loader_type: 'fixed'" in p and "'dynamic'" in p for p in problems())
    wrong_len = problems(dynamic, "runtime.partial_rollout_manager_config.max_rollout_round=3")
    assert any("partial_rollout_manager_config" in p and "one ratio per round" in p for p in wrong_len)
    bad_sum = problems(dynamic, "runtime.partial_rollout_manager_config.rollout_ratio=[0.5,0.6]")
    assert any("must sum to 1" in p for p in bad_sum)
    # ChatLearn asserts mini < num_inference_per_prompt (8 here)
    assert any("must be less than" in p for p in problems(
        dynamic, "runtime.partial_rollout_manager_config.mini_response_per_prompt=8"))
    assert problems(dynamic, "runtime.partial_rollout_manager_config.mini_response_per_prompt=4") == []
    assert problems(dynamic, "runtime.partial_rollout_manager_config.mini_response_per_prompt=7") == []
    # grpo.yaml's responses are 2 tokens: three rounds cannot each have one
    three = problems(dynamic, "runtime.partial_rollout_manager_config.max_rollout_round=3",
                     "runtime.partial_rollout_manager_config.rollout_ratio=[0.3,0.3,0.4]")
    assert any("every round needs at least one" in p for p in three)
    assert any("does not generate with a copy" in p for p in problems(dynamic, config="dpo"))
    assert any("unknown" in p.lower() or "extra" in p.lower() for p in problems(
        dynamic, "runtime.partial_rollout_manager_config.rollout_ratios=[1.0]"))
