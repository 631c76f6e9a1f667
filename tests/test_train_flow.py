"""Integration: two episodes of the embedded default through a real Ray and a real Prefect API."""

import json
import os

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_two_episodes_of_the_default(prefect_api, ray_session, tiny_model_dir, tmp_path, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatlearn.utils.config_loader import load_config
    from flows import train_flow

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    cfg = load_config(os.path.join(REPO, "configs", "default.yaml"), [
        "runtime.num_episode=2", "runtime.sample_per_episode=32", "runtime.generation_batch_size=16",
        "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.eval_episode_interval=1",
        "runtime.save_episode_interval=2", f"runtime.output_dir={tmp_path}", "runtime.exp_name=itest",
    ])
    result = train_flow(cfg)

    run_dir = tmp_path / "itest"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert 0.0 <= r["eval_reward_mean"] <= 1.0
        assert r["episode_seconds"] > 0
        assert r["train_steps"] == 2  # 32 samples / global batch 16
        assert set(r["stage_seconds"]) >= {"generate", "score", "train", "sync", "checkpoint", "eval"}
    assert rows[1]["consumed_samples"] == 64
    assert rows[1]["iteration"] == 4
    # save_episode_interval=2: the trainers checkpointed after episode 1 only, at trainer iteration 4
    assert rows[0]["checkpoint_paths"] == {}
    assert set(rows[1]["checkpoint_paths"]) == {"ppo_policy", "ppo_value"}
    assert os.path.exists(os.path.join(rows[1]["checkpoint_paths"]["ppo_policy"], "model.safetensors"))

    # the final policy is a loadable Hugging Face model, trained away from its init
    final = run_dir / "final" / "policy"
    assert result["final_policy"] == str(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tok("max 1 2 ?").input_ids[0] == tok.bos_token_id
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, init.state_dict()[n])]
    assert len(changed) > 0

    # Prefect saw one subflow per episode, and the artifacts exist
    import asyncio

    async def episode_runs():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=["episode-0", "episode-1"])))
            arts = await client.read_artifacts()
            return runs, arts

    runs, arts = asyncio.run(episode_runs())
    assert {r.name for r in runs} >= {"episode-0", "episode-1"}
    assert all(r.state.is_completed() for r in runs if r.name in ("episode-0", "episode-1"))
    keys = {a.key for a in arts}
    assert {"itest-progress", "itest-metrics"} <= keys


def small_config(tmp_path, tiny_model_dir, exp_name, *extra):
    from chatlearn.utils.config_loader import load_config

    return load_config(os.path.join(REPO, "configs", "default.yaml"), [
        "runtime.num_episode=1", "runtime.sample_per_episode=16", "runtime.generation_batch_size=8",
        "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.eval_episode_interval=0",
        f"runtime.output_dir={tmp_path}", f"runtime.exp_name={exp_name}",
        f"models.policy.args_dict.model_path={tiny_model_dir}", *extra,
    ])


def live_actor_names(namespace):
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def test_rlhf_engine_learn_with_user_module_objects(prefect_api, ray_session, tiny_model_dir, tmp_path,
                                                    monkeypatch):
    import chatlearn
    from chatlearn.models.hf.policy import PolicyInference
    from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer, PPOValueTrainer
    from chatlearn.models.hf.reference import ReferenceModel
    from chatlearn.models.hf.reward import RuleReward
    from chatlearn.models.hf.value import ValueModel

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    chatlearn.init(small_config(tmp_path, tiny_model_dir, "engine"))
    engine = chatlearn.RLHFEngine(PolicyInference("policy"), ReferenceModel("reference"), RuleReward("reward"),
                                  ValueModel("value"), PPOPolicyTrainer("ppo_policy"), PPOValueTrainer("ppo_value"))
    result = engine.learn()
    assert result["episode"] == 0 and result["train_steps"] == 1
    rows = (tmp_path / "engine" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and "eval_reward_mean" not in json.loads(rows[0])
    assert live_actor_names("chatlearn-engine") == []


def test_a_failing_episode_fails_the_run_and_kills_the_actors(prefect_api, ray_session, tiny_model_dir, tmp_path,
                                                              monkeypatch):
    from flows import train_flow

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    # math.sqrt(sample_dict) raises TypeError inside the reward actor during the score task
    cfg = small_config(tmp_path, tiny_model_dir, "boom", "models.reward.args_dict.reward_fn=math:sqrt")
    with pytest.raises(Exception, match="must be real number|TypeError"):
        train_flow(cfg)
    assert live_actor_names("chatlearn-boom") == []
    assert not (tmp_path / "boom" / "final").exists()
