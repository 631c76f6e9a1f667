"""Integration: two episodes of the embedded default through a real Ray and a real Prefect API."""

import json
import os

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_two_episodes_of_the_default(prefect_api, ray_session, tiny_model_dir, tmp_path, monkeypatch):
    """The embedded default as a YAML path, shortened to 2 episodes through its ${num_episode:20} variable."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows import train_flow

    monkeypatch.chdir(tmp_path)  # prompt paths must resolve next to the config, from any directory
    monkeypatch.setenv("num_episode", "2")
    monkeypatch.setenv("CHATLEARN_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    result = train_flow(os.path.join(REPO, "configs", "default.yaml"))

    run_dir = tmp_path / "default"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert r["episode_seconds"] > 0
        assert r["train_steps"] == 4  # 128 samples / global batch 32
        assert r["response_length_mean"] <= 2  # max_new_tokens
        assert set(r["stage_seconds"]) >= {"generate", "score", "train", "sync", "checkpoint"}
    # eval every 2 episodes: after episode 1 only, plus the baseline before training
    assert "eval_reward_mean" not in rows[0] and 0.0 <= rows[1]["eval_reward_mean"] <= 1.0
    assert "eval" in rows[1]["stage_seconds"]
    assert 0.0 <= rows[0]["eval_reward_mean_before_training"] <= 1.0
    assert rows[1]["consumed_samples"] == 256
    assert rows[1]["iteration"] == 8
    assert rows[1]["checkpoint_paths"] == {}  # save_episode_interval is 10

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
    assert {"default-progress", "default-metrics", "default-eval-examples"} <= keys
    # the eval hook of the default config adds exact match to the rows
    assert 0.0 <= rows[1]["eval_exact_match"] <= rows[1]["eval_reward_mean"]


def small_config(tmp_path, tiny_model_dir, exp_name, *extra):
    from chatlearn.config import load_config

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
    chatlearn.init(small_config(tmp_path, tiny_model_dir, "engine", "runtime.save_episode_interval=1"))
    engine = chatlearn.RLHFEngine(PolicyInference("policy"), ReferenceModel("reference"), RuleReward("reward"),
                                  ValueModel("value"), PPOPolicyTrainer("ppo_policy"), PPOValueTrainer("ppo_value"))
    result = engine.learn()
    assert result["episode"] == 0 and result["train_steps"] == 1
    rows = (tmp_path / "engine" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and "eval_reward_mean" not in json.loads(rows[0])
    # save_episode_interval=1: both trainers saved at trainer iteration 1
    paths = json.loads(rows[0])["checkpoint_paths"]
    assert set(paths) == {"ppo_policy", "ppo_value"}
    assert paths["ppo_policy"].endswith(os.path.join("checkpoints", "ppo_policy", "iter_0000001"))
    assert os.path.exists(os.path.join(paths["ppo_value"], "model.safetensors"))
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


def test_bad_config_is_rejected_before_a_flow_run_exists(prefect_api):
    import asyncio

    from prefect import get_client

    from chatlearn.utils.arguments import ConfigError
    from flows import train_flow

    async def count_runs():
        async with get_client() as client:
            return len(await client.read_flow_runs())

    before = asyncio.run(count_runs())
    bad = {"runtime": {"train_global_batch_size": 3},
           "models": {"policy": {"num_cpu": 1, "args_dict": {"max_new_tokens": 0}}}}
    with pytest.raises(ConfigError) as err:
        train_flow(bad)
    assert any(p.startswith("runtime.train_global_batch_size") for p in err.value.problems)
    assert any(p.startswith("models.policy.args_dict.max_new_tokens") for p in err.value.problems)
    assert asyncio.run(count_runs()) == before


def test_eval_flow_scores_a_saved_policy_with_the_post_processing_hook(prefect_api, ray_session, tiny_model_dir,
                                                                       tmp_path, monkeypatch):
    from flows import eval_flow

    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    cfg = small_config(tmp_path, tiny_model_dir, "evalonly")
    metrics = eval_flow(cfg)
    saved = json.loads((tmp_path / "evalonly" / "eval.json").read_text())
    assert saved == json.loads(json.dumps(metrics))
    assert metrics["eval_num_samples"] == 128
    # the default config's hook adds exact match next to the mean reward; exact answers score 1.0
    assert 0.0 <= metrics["eval_exact_match"] <= metrics["eval_reward_mean"] <= 1.0
    assert metrics["model_path"] == tiny_model_dir
    assert live_actor_names("chatlearn-evalonly") == []
