"""A whole run (in this process, on the session's Ray) on the tiny Qwen2 (issue 21): tied input/output embeddings
and grouped-query attention, the traits of Qwen2.5-0.5B / Qwen3-0.6B / Llama-3.2-1B that the default's Llama lacks.

One GRPO run proves several points at once: LoRA on the trainer with a checkpoint every episode (the frozen
tied base written once), the policy in TP 2 (2 KV heads, one per rank) fed by the sync with the debug check on
(every received tensor's digest equals the trainer's), and a merged final policy that loads tied. PPO on the
Qwen2 with every model, checkpoints and an exact resume after SIGKILL: tests/test_resume.py. Layouts and
sharded checkpoints: tests/test_parallel.py; round trips: tests/test_tied_weights.py.
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.conftest import train_here

pytestmark = pytest.mark.integration

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
GRPO = [
    "configs/grpo.yaml", "runtime.num_episode=2", "runtime.sample_per_episode=16", "runtime.generation_batch_size=8",
    "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.save_episode_interval=1",
    "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false",
    *(f"models.{m}.model_config_file=tiny_qwen2.yaml" for m in ("policy", "reference", "ppo_policy")),
    *(f"models.{m}.cpu_per_process=1" for m in ("policy", "reference", "reward", "ppo_policy")),
    "models.policy.tensor_model_parallel_size=2", "models.ppo_policy.num_cpu=1",
    "models.ppo_policy.lora.enable_lora=true", "models.ppo_policy.lora.lora_dim=8",
    "models.ppo_policy.lora.lora_layer=ColumnParallelLinear,RowParallelLinear",
]


def stored(path) -> tuple[set[str], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys()), f.metadata() or {}


def test_grpo_with_lora_and_a_tp2_policy_on_the_tied_qwen2(prefect_api, ray_session, tiny_model_dir, tiny_qwen2_dir,
                                                           tmp_path, monkeypatch):
    train_here([*GRPO, "runtime.exp_name=grpo-qwen2"], tmp_path, tiny_model_dir, monkeypatch,
               CHATLEARN_TINY_QWEN2_DIR=tiny_qwen2_dir)
    run = tmp_path / "grpo-qwen2"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [1, 2]
    ranks = json.loads((run / "placement.json").read_text())["ranks"]
    assert [len(rep) for rep in ranks["policy"]] == [2]  # one replica in TP 2

    ckpt = run / "checkpoints" / "ppo_policy"
    assert sorted(p.name for p in ckpt.iterdir()) == ["base", "iter_0000001", "iter_0000002"]
    names, header = stored(ckpt / "base" / "model.safetensors")
    assert header == {HEAD: EMBED} and EMBED in names and HEAD not in names  # the tied base once
    adapters, _ = stored(ckpt / "iter_0000002" / "model.safetensors")
    assert adapters and all(".lora_" in n for n in adapters)

    start = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    final = AutoModelForCausalLM.from_pretrained(run / "final" / "policy")
    assert type(final).__name__ == "Qwen2ForCausalLM"
    assert final.lm_head.weight.data_ptr() == final.model.embed_tokens.weight.data_ptr()
    assert HEAD not in stored(run / "final" / "policy" / "model.safetensors")[0]
    # LoRA leaves the tied embedding alone and merges what it trained into the projections
    assert torch.equal(final.lm_head.weight, start.lm_head.weight)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(final.state_dict()[q], start.state_dict()[q])
