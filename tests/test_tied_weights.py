"""Tied weights (issue 21): a model whose input and output embeddings are one tensor (Qwen2.5-0.5B, Qwen3-0.6B,
Llama-3.2-1B) is checkpointed, restored and exported with the tensor stored once and tied again on load.

In-process, no Ray: the tiny Qwen2 of configs/tiny_qwen2.yaml (tied, 4 heads over 2 KV heads) through the real
modules; the trainer round trips also on the tied tiny Qwen3 (configs/tiny_qwen3.yaml: q/k norms, head_dim
apart from hidden_size). Sharded checkpoints, pipeline stages and the TP sync of it run in tests/test_parallel.py,
whole runs in tests/test_qwen2_runs.py and tests/test_architectures.py.
"""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model
from transformers import AutoModelForCausalLM

from chatlearn.checkpoint.model_checkpoint import load_model_checkpoint, save_model_checkpoint
from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer
from chatlearn.models.hf.tiny import TinyModelSpec, ensure_tiny_model
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# peft 0.21 calls a transformers API that 5.x deprecates; nothing of ours
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def stored(path: str) -> tuple[set[str], dict[str, str]]:
    """The tensor names a safetensors file holds, and its header metadata."""
    with safe_open(path, "pt") as f:
        return set(f.keys()), f.metadata() or {}


def zeroed(path: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_the_tiny_qwen2_has_tied_embeddings_and_grouped_query_attention(tiny_qwen2_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and tied(model)
    attn = model.model.layers[0].self_attn
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    assert attn.k_proj.out_features == attn.q_proj.out_features // 2 == 2 * attn.head_dim
    # a tiny model built before `architecture` existed (its marker lacks the field) is still the Llama spec
    old = tmp_path / "old"
    ensure_tiny_model(old, {"num_hidden_layers": 1})
    marker = json.loads((old / "chatlearn_tiny_spec.json").read_text())
    del marker["architecture"]
    (old / "chatlearn_tiny_spec.json").write_text(json.dumps(marker))
    assert ensure_tiny_model(old, {"num_hidden_layers": 1}) == old
    with pytest.raises(ValueError, match="different spec"):
        ensure_tiny_model(old, TinyModelSpec(architecture="qwen2", num_hidden_layers=1))


def test_a_tied_state_dict_is_stored_once_and_loads_tied(tiny_qwen2_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    save_model_checkpoint(str(tmp_path / "ck"), model.state_dict(), meta={"iteration": 1})
    names, header = stored(str(tmp_path / "ck" / "model.safetensors"))
    # the shared tensor once, the other name an alias in the header: safetensors' own save_model convention
    assert EMBED in names and HEAD not in names and len(names) == len(model.state_dict()) - 1
    assert header == {HEAD: EMBED}
    weights = load_model_checkpoint(str(tmp_path / "ck"))["weights"]
    assert weights.keys() == model.state_dict().keys() and weights[HEAD] is weights[EMBED]
    fresh = zeroed(tiny_qwen2_dir)
    fresh.load_state_dict(weights, strict=True)
    assert tied(fresh)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    # and safetensors' loader reads the file into a model as its own save_model output
    other = zeroed(tiny_qwen2_dir)
    load_model(other, str(tmp_path / "ck" / "model.safetensors"))
    assert tied(other) and torch.equal(other.lm_head.weight, model.lm_head.weight)


class Window(torch.nn.Module):
    """A module whose state dict shares memory only in part: a buffer that is a view of a weight's row."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(12.0).view(3, 4))
        self.register_buffer("row", self.weight.data[1])


def test_memory_shared_in_part_is_stored_apart_and_the_module_keeps_sharing(tmp_path):
    module = Window()
    save_model_checkpoint(str(tmp_path / "ck"), module.state_dict())
    weights = load_model_checkpoint(str(tmp_path / "ck"))["weights"]
    assert torch.equal(weights["row"], torch.arange(4.0, 8.0)) and torch.equal(weights["weight"], module.weight)
    fresh = Window()
    with torch.no_grad():
        fresh.weight.zero_()
    fresh.load_state_dict(weights)
    assert torch.equal(fresh.weight, module.weight) and fresh.row.data_ptr() == fresh.weight[1].data_ptr()


@pytest.fixture(params=["qwen2", "qwen3"])
def tied_dir(request):
    """A tied tiny model of each family that ties (the session's build)."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def micro_batches(n: int = 2, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 3)
    return [{"prompt_ids": torch.randint(4, 30, (2, 4), generator=g), "prompt_mask": torch.ones(2, 4),
             "response_ids": torch.randint(4, 30, (2, 3), generator=g), "response_mask": mask,
             "logprobs": -torch.rand(2, 3, generator=g) * 3, "advantages": torch.randn(2, 3, generator=g)}
            for _ in range(n)]


def trainer(path: str, out: str, lora: dict | None = None) -> PPOPolicyTrainer:
    module = PPOPolicyTrainer("ppo_policy")
    module.bind(ModelConfig(num_cpu=1, trainable=True, args_dict={"model_path": path, "lr": 1e-2},
                            lora=lora or {}), RuntimeConfig(output_dir=out, exp_name="tied"), 0, seed=7)
    module.setup()
    return module


def test_a_tied_trainer_checkpoints_resumes_bit_exactly_and_exports_tied(tied_dir, tmp_path):
    first = trainer(tied_dir, str(tmp_path))
    first.train_step(micro_batches(seed=0), 0)
    path = first.save_checkpoint(1)
    assert stored(os.path.join(path, "model.safetensors"))[1] == {HEAD: EMBED}
    again = trainer(tied_dir, str(tmp_path))
    again.load_checkpoint(1)
    assert tied(again.model)
    # the restored trainer takes the next step exactly as the one that never stopped (the tie trains as one)
    for module in (first, again):
        module.train_step(micro_batches(seed=1), 1)
    want, got = first.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want) and tied(again.model)
    weights = again.get_weights()  # what the object-store sync hands over: every name, the pair one tensor
    assert weights.keys() == want.keys() and weights[HEAD] is weights[EMBED]

    out = again.export_hf(str(tmp_path / "final"))
    assert HEAD not in stored(os.path.join(out, "model.safetensors"))[0]
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert tied(exported) and torch.equal(exported.lm_head.weight, want[HEAD])


def test_lora_on_the_tied_model_writes_the_base_once_and_exports_it_merged_and_tied(tied_dir, tmp_path):
    lora = {"enable_lora": True, "lora_dim": 4, "lora_layer": "ColumnParallelLinear,RowParallelLinear"}
    first = trainer(tied_dir, str(tmp_path), lora)
    first.train_step(micro_batches(seed=0), 0)
    first.save_checkpoint(1)
    names, header = stored(os.path.join(first.lora_base_dir(), "model.safetensors"))
    assert header == {HEAD: EMBED} and HEAD not in names
    again = trainer(tied_dir, str(tmp_path), lora)
    again.load_checkpoint(1)  # verifies the saved base against its own: equal, and the pair still one tensor
    base = again.model.get_base_model()
    assert tied(base)
    merged = again.get_weights()
    assert all(torch.equal(merged[k], v) for k, v in first.get_weights().items())

    out = again.export_hf(str(tmp_path / "final"))
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert tied(exported) and HEAD not in stored(os.path.join(out, "model.safetensors"))[0]
    assert all(torch.equal(v, merged[k]) for k, v in exported.state_dict().items())
