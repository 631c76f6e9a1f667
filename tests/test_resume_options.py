"""Resume options through the real train flow (in-process: real Ray + the Prefect test harness).

ChatLearn's numbers (chatlearn.md 5.3 #8): 16 samples per episode, global batch 8, save every episode, 4
episodes -> trainer iteration 8; `load_data_checkpoint_iteration=2` resumes after episode 1 (start episode 1)
and ends at iteration 8 again, with the same weights; `enable_resume_training: false` starts over.
"""

import json
import os

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def config(tmp_path, tiny_model_dir, *extra):
    from chatlearn.config import load_config

    return load_config(os.path.join(REPO, "configs", "default.yaml"), [
        "runtime.num_episode=4", "runtime.sample_per_episode=16", "runtime.generation_batch_size=4",
        "runtime.train_micro_batch_size=4", "runtime.train_global_batch_size=8", "runtime.save_episode_interval=1",
        "runtime.eval_episode_interval=0", "runtime.max_data_ckpt_nums=3", f"runtime.output_dir={tmp_path}",
        "runtime.exp_name=opts", f"models.policy.args_dict.model_path={tiny_model_dir}", *extra,
    ])


def rows(tmp_path):
    out = []
    for line in (tmp_path / "opts" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        timing = ("episode_seconds", "stage_seconds", "peak_memory_mb", "startup_seconds")
        out.append({k: v for k, v in r.items() if k not in timing})
    return out


def policy_weights(tmp_path):
    from safetensors.torch import load_file

    return load_file(str(tmp_path / "opts" / "final" / "policy" / "model.safetensors"))


def test_resume_from_a_chosen_iteration_and_fresh_start(prefect_api, ray_session, tiny_model_dir, tmp_path,
                                                        monkeypatch, capfd):
    from chatlearn.checkpoint.data_checkpoint import DataCheckpointStore
    from flows import train_flow

    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    first = train_flow(config(tmp_path, tiny_model_dir))
    assert first["iteration"] == 8  # 4 episodes x ceil(16 / 8)
    reference_rows, reference_weights = rows(tmp_path), policy_weights(tmp_path)
    store = DataCheckpointStore(str(tmp_path / "opts" / "data_checkpoints"))
    assert store.iterations() == [4, 6, 8]  # max_data_ckpt_nums=3 dropped iteration 2's record
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    async def pointer():  # by key: the session's API holds every test's artifacts, more than one page
        async with get_client() as client:
            return await client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(
                key=ArtifactCollectionFilterKey(any_=["opts-data-checkpoint"])))

    arts = {a.key: a for a in asyncio.run(pointer())}
    assert "trainer iteration 8" in arts["opts-data-checkpoint"].data
    assert sorted(os.listdir(tmp_path / "opts" / "checkpoints" / "ppo_policy")) == [
        "iter_0000004", "iter_0000006", "iter_0000008"]

    # choose the record of trainer iteration 4 (after episode 2): episodes 3 and 4 run again
    capfd.readouterr()
    again = train_flow(config(tmp_path, tiny_model_dir, "runtime.load_data_checkpoint_iteration=4"))
    assert "resuming after episode 2 (trainer iteration 4" in capfd.readouterr().err
    assert again["iteration"] == 8
    assert rows(tmp_path) == reference_rows
    assert all(torch.equal(v, reference_weights[k]) for k, v in policy_weights(tmp_path).items())

    # an iteration with no record is a clear error naming what exists
    from chatlearn.checkpoint.model_checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"load_data_checkpoint_iteration=2: .*available: \[4, 6, 8\]"):
        train_flow(config(tmp_path, tiny_model_dir, "runtime.load_data_checkpoint_iteration=2"))

    # enable_resume_training: false -> a fresh run from episode 0 (2 episodes here), same rows (same seed)
    capfd.readouterr()
    fresh = train_flow(config(tmp_path, tiny_model_dir, "runtime.enable_resume_training=false",
                              "runtime.num_episode=2"))
    assert "resuming" not in capfd.readouterr().err
    assert fresh["iteration"] == 4
    assert rows(tmp_path) == reference_rows[:2]


def test_training_does_not_depend_on_the_generation_batch_size(prefect_api, ray_session, tiny_model_dir, tmp_path,
                                                              monkeypatch):
    """ChatLearn's test_indivisible_batchsz: generation batches of 4 and of 5 (16 samples per episode, so a
    short last batch) give the same training data. The responses are the same (per-sample sampling seeds), so
    the rewards are equal exactly, in the second episode too, after training on the first. (Weights are not
    compared bit for bit: differently padded forward passes round differently, and Adam magnifies that.)"""
    from flows import train_flow

    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    results = {}
    for gbs in (4, 5):
        out = tmp_path / f"gbs{gbs}"
        train_flow(config(out, tiny_model_dir, "runtime.num_episode=2", f"runtime.generation_batch_size={gbs}",
                          "runtime.save_episode_interval=0"))
        results[gbs] = rows(out)
    rows4, rows5 = results[4], results[5]
    assert [r["reward_mean"] for r in rows4] == [r["reward_mean"] for r in rows5]
    assert [r["response_length_mean"] for r in rows4] == [r["response_length_mean"] for r in rows5]
    assert [r["train_steps"] for r in rows4] == [r["train_steps"] for r in rows5] == [2, 2]
    # episode 1 trains on the same samples from the same weights: the same loss up to rounding
    assert rows4[0]["policy_loss"] == pytest.approx(rows5[0]["policy_loss"], abs=1e-4)
