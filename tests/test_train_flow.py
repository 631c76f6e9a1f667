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
