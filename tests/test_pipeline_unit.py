"""Pipelined episodes (`runtime.max_staleness`) without Ray: which weights an episode generates on, which samples
are too old to train, the config's refusals, and the gates an episode started ahead waits at."""

import os
import pickle
import threading
import time

import pytest

from chatlearn.config import ConfigError, EngineChecks, RuntimeConfig, load_config
from chatlearn.data.sampler import episode_generation_batches
from chatlearn.data.staleness import drop_stale
from chatlearn.runtime.calls.waiting import StageTimeout
from chatlearn.runtime.context import Actors, RunContext
from chatlearn.runtime.episodes import EpisodeGate, Pipeline, PipelineStopped
from chatlearn.runtime.plan import EpisodePlan
from chatlearn.runtime.rollout import Rollout
from chatlearn.runtime.spec import RunSpec
from chatlearn.runtime.weights.sync import SyncRoute
from chatlearn.runtime.weights.versions import PolicyWeights, WeightVersions, generation_version
from tests.conftest import REPO


def test_an_episode_generates_on_the_weights_of_k_episodes_before():
    assert [generation_version(e, 0) for e in range(4)] == [0, 1, 2, 3]  # synchronous: the latest
    assert [generation_version(e, 1) for e in range(4)] == [0, 0, 1, 2]
    assert [generation_version(e, 2) for e in range(5)] == [0, 0, 0, 1, 2]


def test_stale_samples_are_dropped_with_their_group_and_counted():
    # trainer at version 5, max_staleness 2: ages 0, 1, 3, 2, 2, 4
    samples = [{"id": i, "policy_version": v} for i, v in enumerate([5, 4, 2, 3, 3, 1])]
    kept, m = drop_stale(samples, 5, 2)
    assert [s["id"] for s in kept] == [0, 1, 3, 4]
    assert m == {"staleness_mean": 2.0, "staleness_max": 4.0, "dropped_stale": 2.0}
    # groups of 2: the group holding an age-3 sample goes whole (ids 2 and 3), as does the one with age 4
    kept, m = drop_stale(samples, 5, 2, group_size=2)
    assert [s["id"] for s in kept] == [0, 1]
    assert m["dropped_stale"] == 4.0
    # no version: generated on the current weights
    assert drop_stale([{"x": 1}], 3, 0) == ([{"x": 1}], {"staleness_mean": 0.0, "staleness_max": 0.0,
                                                         "dropped_stale": 0.0})


def _problems(config, *overrides):
    try:
        load_config(os.path.join(REPO, "configs", config), list(overrides), [EngineChecks()])
        return []
    except ConfigError as exc:
        return exc.problems


def test_the_async_config_passes_and_the_layouts_that_cannot_pipeline_are_refused_by_name():
    assert _problems("grpo_async.yaml") == []
    # the shipped GRPO colocates the policy with its trainer: one process cannot generate while it trains
    (problem,) = _problems("grpo.yaml", "runtime.max_staleness=1")
    assert problem.startswith("runtime.colocation: 'policy' is colocated with ['reference', 'reward', 'ppo_policy']")
    assert "max_staleness: 1" in problem
    assert any(p.startswith("models.policy.sync_frequency: 2 with runtime.max_staleness: 1 is not supported yet")
               for p in _problems("grpo_async.yaml", "models.policy.sync_frequency=2"))
    # (one optimizer step an episode, so only the staleness makes it wrong)
    (problem,) = _problems("grpo_async.yaml", "models.ppo_policy.args_dict.old_logprobs=current",
                           "runtime.train_global_batch_size=128", "runtime.train_micro_batch_size=64")
    assert problem.startswith("models.ppo_policy.args_dict.old_logprobs: current") and "max_staleness: 1" in problem
    # with a rollout correction the detached training log-probs are the proximal ones, the sampler's the behaviour
    assert _problems("grpo_async.yaml", "models.ppo_policy.args_dict.old_logprobs=current",
                     "models.ppo_policy.args_dict.rollout_correction=decoupled",
                     "runtime.train_global_batch_size=128", "runtime.train_micro_batch_size=64") == []
    (problem,) = _problems("grpo_async.yaml", "models.ppo_policy.args_dict.rollout_correction=decoupled")
    assert "set old_logprobs: trainer (its forward pass) or current" in problem
    (problem,) = _problems("dpo.yaml", "runtime.max_staleness=1")
    assert problem.startswith("runtime.max_staleness: 1, but the 'dpo' engine does not generate")
    assert any("max_staleness" in p and "greater than or equal to 0" in p
               for p in _problems("grpo_async.yaml", "runtime.max_staleness=-1"))


def test_a_gate_opens_with_the_start_iteration_and_gives_up_with_the_reason():
    gate = EpisodeGate()
    got = []
    waiter = threading.Thread(target=lambda: got.append(gate.wait()))
    waiter.start()
    time.sleep(0.3)
    assert not got  # still waiting: the episode before is not done
    gate.open(12)
    waiter.join(5)
    assert got == [12]
    assert EpisodeGate(3).wait() == 3  # a synchronous episode's: open from the start
    stopped = EpisodeGate()
    stopped.give_up("episode 2 failed")
    with pytest.raises(PipelineStopped, match="episode 2 failed"):
        stopped.wait()
    with pytest.raises(PipelineStopped):
        stopped.wait_generated()
    # what a Prefect task on Ray gets of it with the flow run's parameters: its description
    assert pickle.loads(pickle.dumps(EpisodeGate(4))) == "EpisodeGate(start_iteration=4)"


def _ctx(weights=None, max_staleness=0, seed=None, num_episode=10):
    """A run's context for the pipeline alone: 100 prompts, 24 samples an episode in groups of 4, one replica."""
    runtime = RuntimeConfig(sample_per_episode=24, generation_batch_size=8, max_staleness=max_staleness,
                            data_shuffle=seed is not None, seed=seed or 0, num_episode=num_episode)
    spec = RunSpec(runtime=runtime, engine="grpo", plan=EpisodePlan(), generation_batch_size=8, group_size=4)
    return RunContext(spec, Actors({"policy": [["w1"]]}, {"w1": None}), None,
                      Rollout(spec, weights or PolicyWeights()), calls=None, dataset_size=100)


def test_episodes_started_ahead_read_the_prompts_the_synchronous_run_reads(monkeypatch):
    monkeypatch.setattr(EpisodePlan, "producer", property(lambda self: "policy"))
    pipe = Pipeline(_ctx(max_staleness=2, seed=7), lambda *a: None, first=3, consumed_samples=72)
    consumed, expected = 72, {}
    for episode in range(3, 8):  # the synchronous loop: each episode's generate stage reports its samples
        expected[episode] = consumed
        consumed += sum(len(idx) for _, idx, _ in episode_generation_batches(100, consumed, 24, 8, 1, 7, 4))
    assert {e: pipe.consumed_before(e) for e in range(3, 8)} == expected
    assert expected[4] == 96  # 24 a episode: hand-checked
    pipe.close()


def test_waiting_for_a_version_ends_at_the_deadline_or_when_the_pipeline_gives_up():
    route = SyncRoute(key="ppo_policy->policy", src="ppo_policy", dst="policy", src_ranks=["a"], dst_ranks=[["b"]])
    versions = WeightVersions(route, actor=None, max_staleness=1, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(StageTimeout, match=r"episode 3, generate: the policy weights of version 2 \(ppo_policy "
                                           r"after 2 episode\(s\) of training\) were not there after 0.5 s"):
        versions.wait_for(2, "episode 3, generate")
    assert 0.4 < time.monotonic() - t0 < 3
    with pytest.raises(PipelineStopped, match="given up"):
        versions.wait_for(2, "x", timeout_s=30, given_up=lambda: PipelineStopped("given up"))
    versions._put(2, "ref")  # published: no wait
    versions.wait_for(2, "x")
    versions.release_below(3)
    assert versions.versions() == []
    assert pickle.loads(pickle.dumps(versions)) == "WeightVersions(ppo_policy->policy, max_staleness=1)"


def test_the_next_episode_starts_while_this_one_trains_and_scores_only_after_it(monkeypatch):
    """The pipeline's order with k = 1, on fake episodes: episode 1's subflow starts once episode 0 has generated
    (while 0 is still running), and passes its gate only after the train flow took episode 0's result."""
    monkeypatch.setattr(EpisodePlan, "producer", property(lambda self: "policy"))
    route = SyncRoute(key="ppo_policy->policy", src="ppo_policy", dst="policy", src_ranks=["a"], dst_ranks=[["b"]])
    versions = WeightVersions(route, actor=None, max_staleness=1, timeout_s=10)
    versions._put(0, "v0")  # published at the start
    ctx = _ctx(versions, max_staleness=1, num_episode=3)
    events, started = [], {e: threading.Event() for e in range(3)}

    def call(episode, params, next_episode):
        started[episode].set()
        events.append(("generated", episode))
        params["gate"].generated()
        if episode == 0:  # still "training" when episode 1 starts
            assert started[1].wait(5)
        start_iteration = params["gate"].wait()
        events.append(("trained", episode, start_iteration))
        versions._put(episode + 1, f"v{episode + 1}")  # the sync stage's publish
        return {"episode": episode, "iteration": start_iteration + 2}

    prepared = []
    pipe = Pipeline(ctx, call, first=0, consumed_samples=0, prepare=prepared.append)
    iteration = 0
    for episode in range(3):
        iteration = pipe.run(episode, None, iteration)["iteration"]
    pipe.close()
    assert iteration == 6
    assert events.index(("generated", 1)) < events.index(("trained", 0, 0))  # overlap
    assert [e for e in events if e[0] == "trained"] == [("trained", 0, 0), ("trained", 1, 2), ("trained", 2, 4)]
    assert prepared[:3] == [0, 1, 2]  # flow runs asked for an episode before they may start


def test_a_saved_version_keeps_tied_weights_one_tensor(tmp_path):
    """A version written with the checkpoint (`_save_weights`, run as a Ray task) and read back for a resume:
    a tied embedding is stored once, with its alias in the header, and comes back as one tensor."""
    import torch

    from chatlearn.checkpoint.model_checkpoint import load_weights
    from chatlearn.runtime.weights.versions import _save_weights

    embed = torch.randn(5, 3)
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.ones(3)}
    path = _save_weights(weights, str(tmp_path / "version_0000001.safetensors"))
    back = load_weights(path)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]
    assert not (tmp_path / "version_0000001.safetensors.tmp").exists()
