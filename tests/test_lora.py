"""LoRA on peft for the built-in HF trainers (`chatlearn.models.hf.lora`): every `LoraConfig` field acts, merged
weights equal peft's own merge, and the trainer mixin's checkpoints/exports round-trip. CPU only, tiny local
models, no Ray, no Prefect."""

import copy
import os
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from chatlearn.checkpoint.model_checkpoint import CheckpointError, load_model_checkpoint
from chatlearn.models.hf.lora import (
    LoraTrainerMixin,
    adapter_state_dict,
    apply_lora,
    base_state_dict,
    load_adapter_state_dict,
    lora_target_modules,
    merged_state_dict,
    param_counts,
)
from chatlearn.models.hf.tiny import ensure_tiny_model
from chatlearn.models.torch_module import TorchModule
from chatlearn.utils.arguments import LoraConfig, ModelConfig, RuntimeConfig

# hidden 32, 4 query heads of 8 and 2 KV heads (k/v out 16), MLP 64, 2 layers, vocab 40
SPEC = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 32}
H, FFN, KV, LAYERS = 32, 64, 16, 2
# peft 0.21 calls a transformers API that 5.x deprecates; nothing of ours
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(ensure_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", SPEC))


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    return str(ensure_tiny_model(tmp_path_factory.mktemp("lora") / "tied", {**SPEC, "tie_word_embeddings": True}))


def load(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def vocab(path):
    return load(path).config.vocab_size


def lcfg(**kw):
    return LoraConfig(enable_lora=True, **kw)


def layer_names(leaves, layers=range(LAYERS)):
    return [f"model.layers.{i}.{'self_attn' if leaf in ATTN else 'mlp'}.{leaf}" for i in layers
            for leaf in (*ATTN, *MLP) if leaf in leaves]


def randomize(model, std=0.05, seed=0):
    """Nonzero A and B everywhere (peft starts each adapter with one of them zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in adapter_state_dict(model).values():
            t.copy_(torch.randn(t.shape, generator=g) * std)


def logits(model, path, seed=0):
    ids = torch.randint(4, vocab(path), (3, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


def lora_module(peft_model, name):
    return peft_model.get_base_model().get_submodule(name)


# -- lora_layer / column_only_qkv / part_module_name --------------------------------------------------------------
def test_default_lora_layer_selects_every_linear_and_embedding(tiny):
    assert lora_target_modules(load(tiny), lcfg()) == ["model.embed_tokens", *layer_names(ATTN + MLP), "lm_head"]


@pytest.mark.parametrize("layers, expected", [
    ("ColumnParallelLinear", layer_names({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})),
    ("RowParallelLinear", layer_names({"o_proj", "down_proj"})),
    ("LinearLayer", ["lm_head"]),
    ("Embedding", ["model.embed_tokens"]),
    ("VocabParallelEmbedding", ["model.embed_tokens"]),
    (" RowParallelLinear , LinearLayer ", [*layer_names({"o_proj", "down_proj"}), "lm_head"]),
])
def test_lora_layer_picks_the_documented_modules(tiny, layers, expected):
    model = load(tiny)
    assert lora_target_modules(model, lcfg(lora_layer=layers)) == expected
    peft_model = apply_lora(model, lcfg(lora_layer=layers))
    adapted = [n for n, m in peft_model.get_base_model().named_modules() if hasattr(m, "lora_A")]
    assert adapted == expected  # peft adapted exactly the listed modules


def test_unknown_layer_name_is_an_error_naming_it_and_the_known_ones(tiny):
    with pytest.raises(ValueError, match=r"unknown layer name\(s\) \['ColumnLinear'\].*RowParallelLinear"):
        lora_target_modules(load(tiny), lcfg(lora_layer="ColumnLinear,RowParallelLinear"))


def test_column_only_qkv_restricts_column_parallel_layers_to_qkv(tiny):
    model = load(tiny)
    assert lora_target_modules(model, lcfg(lora_layer="ColumnParallelLinear", column_only_qkv=True)) == \
        layer_names({"q_proj", "k_proj", "v_proj"})
    # as in ChatLearn, it filters only the ColumnParallelLinear branch: the other listed kinds stay
    got = lora_target_modules(model, lcfg(column_only_qkv=True))
    assert got == ["model.embed_tokens", *layer_names(set(ATTN) | {"down_proj"}), "lm_head"]
    assert not any(n.endswith(("gate_proj", "up_proj")) for n in got)


def test_part_module_name_keeps_modules_whose_name_contains_it(tiny):
    model = load(tiny)
    assert lora_target_modules(model, lcfg(part_module_name="layers.0.")) == layer_names(ATTN + MLP, [0])
    assert lora_target_modules(model, lcfg(part_module_name="mlp", lora_layer="RowParallelLinear")) == \
        layer_names({"down_proj"})
    with pytest.raises(ValueError, match=r"0 left by part_module_name='layers.7.'"):
        lora_target_modules(model, lcfg(part_module_name="layers.7."))
    with pytest.raises(ValueError, match=r"0 left by part_module_name='layers.0.'"):
        lora_target_modules(model, lcfg(part_module_name="layers.0.", lora_layer="LinearLayer"))


def test_tied_embeddings_are_skipped_so_the_merge_stays_exact(tiny_tied):
    model = load(tiny_tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert lora_target_modules(model, lcfg()) == layer_names(ATTN + MLP)
    with pytest.raises(ValueError, match=r"tied-weight modules \['model.embed_tokens', 'lm_head'\]"):
        lora_target_modules(model, lcfg(lora_layer="Embedding,LinearLayer"))
    peft_model = apply_lora(model, lcfg())
    randomize(peft_model)
    plain = load(tiny_tied)
    plain.load_state_dict(merged_state_dict(peft_model), strict=True)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    assert torch.allclose(logits(plain, tiny_tied), logits(peft_model, tiny_tied), atol=1e-5)


def test_gpt2_style_fused_conv1d_layers_map_and_merge():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16))
    # wte and lm_head are tied, so both are skipped; wpe is an untied nn.Embedding
    assert lora_target_modules(model, lcfg()) == ["transformer.wpe", "transformer.h.0.attn.c_attn",
                                                  "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                                                  "transformer.h.0.mlp.c_proj"]
    assert lora_target_modules(model, lcfg(lora_layer="ColumnParallelLinear", column_only_qkv=True)) == \
        ["transformer.h.0.attn.c_attn"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft notes that Conv1D needs fan_in_fan_out and sets it per layer
        peft_model = apply_lora(model, lcfg(lora_dim=2))
    randomize(peft_model)
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    merged = merged_state_dict(peft_model)
    assert list(merged) == list(expected) and all(torch.equal(merged[k], expected[k]) for k in expected)


# -- lora_dim / lora_dropout / lora_scaling -----------------------------------------------------------------------
@pytest.mark.parametrize("r", [3, 5])
def test_lora_dim_sets_the_adapter_shapes(tiny, r):
    peft_model = apply_lora(load(tiny), lcfg(lora_dim=r))
    shapes = {"model.layers.0.self_attn.q_proj": (H, H), "model.layers.1.self_attn.k_proj": (H, KV),
              "model.layers.0.mlp.down_proj": (FFN, H), "lm_head": (H, vocab(tiny))}  # (fan_in, fan_out)
    for name, (fan_in, fan_out) in shapes.items():
        mod = lora_module(peft_model, name)
        assert mod.lora_A["default"].weight.shape == (r, fan_in), name
        assert mod.lora_B["default"].weight.shape == (fan_out, r), name
    emb = lora_module(peft_model, "model.embed_tokens")
    assert emb.lora_embedding_A["default"].shape == (r, vocab(tiny))
    assert emb.lora_embedding_B["default"].shape == (H, r)


def test_lora_dropout_is_the_adapter_input_dropout(tiny):
    off = apply_lora(load(tiny), lcfg())
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity)
               for m in off.get_base_model().modules() if hasattr(m, "lora_dropout"))
    on = apply_lora(load(tiny), lcfg(lora_dropout=0.25))
    ps = {type(m.lora_dropout["default"]).__name__: m.lora_dropout["default"].p
          for m in on.get_base_model().modules() if hasattr(m, "lora_dropout")}
    assert ps == {"Dropout": 0.25}
    randomize(on, std=0.3)
    q = lora_module(on, "model.layers.0.self_attn.q_proj")
    x = torch.randn(4, H)
    q.train()
    assert not torch.equal(q(x), q(x))  # the adapter path is dropped out at random while training
    q.eval()
    assert torch.equal(q(x), q(x))


def test_lora_scaling_is_chatlearns_merge_factor(tiny):
    s, r = 0.37, 3  # (0.37 * 3) / 3 != 0.37 in floating point: the scaling is pinned, not recomputed
    peft_model = apply_lora(load(tiny), lcfg(lora_dim=r, lora_scaling=s))
    randomize(peft_model)
    merged, base = merged_state_dict(peft_model), base_state_dict(peft_model)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        mod = lora_module(peft_model, name)
        assert mod.scaling["default"] == s
        A, B = mod.lora_A["default"].weight.detach(), mod.lora_B["default"].weight.detach()
        W = base[f"{name}.weight"]
        assert torch.equal(merged[f"{name}.weight"], W + (B @ A) * s)  # W = W + B·A·lora_scaling, bitwise
        assert torch.allclose(merged[f"{name}.weight"] - W, s * B @ A, atol=1e-6)
        x = torch.randn(2, W.shape[1])  # and training's forward uses the same factor
        with torch.no_grad():
            assert torch.allclose(mod(x), x @ W.T + s * (x @ A.T @ B.T), atol=1e-6)
    emb = lora_module(peft_model, "model.embed_tokens")
    A, B = emb.lora_embedding_A["default"].detach(), emb.lora_embedding_B["default"].detach()
    delta = merged["model.embed_tokens.weight"] - base["model.embed_tokens.weight"]
    assert torch.allclose(delta, s * (B @ A).T, atol=1e-6)
    doubled = apply_lora(load(tiny), lcfg(lora_dim=r, lora_scaling=2 * s))
    load_adapter_state_dict(doubled, adapter_state_dict(peft_model))
    d2 = merged_state_dict(doubled)["model.layers.0.self_attn.q_proj.weight"] - \
        base["model.layers.0.self_attn.q_proj.weight"]
    assert torch.allclose(d2, 2 * (merged["model.layers.0.self_attn.q_proj.weight"] -
                                   base["model.layers.0.self_attn.q_proj.weight"]), atol=1e-6)


# -- training, merging -------------------------------------------------------------------------------------------
def train_step(model, path, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    ids = torch.randint(4, vocab(path), (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return opt


def test_only_adapters_train(tiny):
    peft_model = apply_lora(load(tiny), lcfg())
    adapters = set(adapter_state_dict(peft_model))
    hf = peft_model.get_base_model()
    assert {n for n, p in hf.named_parameters() if p.requires_grad} == adapters
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    train_step(peft_model, tiny)
    changed = {k for k, v in hf.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and changed <= adapters
    # every Linear's B (zero-initialised, nonzero gradient) and the embedding's A moved
    assert {k for k in adapters if ".lora_B." in k or "lora_embedding_A" in k} <= changed


def test_merged_state_dict_equals_peft_merge_and_leaves_the_model_training(tiny):
    peft_model = apply_lora(load(tiny), lcfg(lora_scaling=1.5))
    train_step(peft_model, tiny)
    out_before = logits(peft_model, tiny)
    merged = merged_state_dict(peft_model)
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    # bitwise: the same get_delta_weight and the same in-place add as peft's merge
    assert list(merged) == list(expected) == list(load(tiny).state_dict())
    assert all(torch.equal(merged[k], expected[k]) for k in expected)
    assert not any(lora_module(peft_model, n).merged for n in lora_target_modules(load(tiny), lcfg()))
    assert torch.equal(logits(peft_model, tiny), out_before)
    train_step(peft_model, tiny)  # still a LoRA model that trains
    assert not torch.equal(logits(peft_model, tiny), out_before)


def test_merged_weights_load_strictly_into_a_plain_model_and_match_logits(tiny):
    peft_model = apply_lora(load(tiny), lcfg())
    randomize(peft_model)
    plain = load(tiny)
    assert not torch.allclose(logits(plain, tiny), logits(peft_model, tiny), atol=1e-3)
    plain.load_state_dict(merged_state_dict(peft_model), strict=True)
    assert torch.allclose(logits(plain, tiny), logits(peft_model, tiny), atol=1e-5)


def test_merged_state_dict_is_bitwise_peft_merge_in_bfloat16(tiny):
    peft_model = apply_lora(load(tiny, torch.bfloat16), lcfg(lora_dim=4, lora_scaling=0.7))
    randomize(peft_model)
    merged = merged_state_dict(peft_model)
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert all(merged[k].dtype == torch.bfloat16 and torch.equal(merged[k], expected[k]) for k in expected)


def test_adapter_state_round_trips(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    src = apply_lora(load(tiny), lcfg(lora_dim=4))
    randomize(src)
    sd = adapter_state_dict(src)
    assert sd and all("lora_" in k for k in sd)
    assert set(sd) == {k for k in src.get_base_model().state_dict() if ".lora_" in k}
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "adapters.safetensors")
    dst = apply_lora(load(tiny), lcfg(lora_dim=4))
    assert not torch.equal(logits(dst, tiny), logits(src, tiny))
    load_adapter_state_dict(dst, load_file(tmp_path / "adapters.safetensors"))
    assert all(torch.equal(v, sd[k]) for k, v in adapter_state_dict(dst).items())
    assert torch.equal(logits(dst, tiny), logits(src, tiny))
    with pytest.raises(ValueError, match="missing"):
        load_adapter_state_dict(dst, dict(list(sd.items())[1:]))
    with pytest.raises(ValueError, match="unexpected"):
        load_adapter_state_dict(apply_lora(load(tiny), lcfg(lora_dim=4, lora_layer="LinearLayer")), sd)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_adapter_state_dict(apply_lora(load(tiny), lcfg(lora_dim=2)), sd)


def test_param_counts(tiny):
    plain = load(tiny)
    n_base = sum(p.numel() for p in plain.parameters())
    assert param_counts(plain) == (n_base, n_base)
    r, V = 4, vocab(tiny)
    per_layer = sum(r * (fan_in + fan_out) for fan_in, fan_out in
                    [(H, H), (H, KV), (H, KV), (H, H), (H, FFN), (H, FFN), (FFN, H)])  # q k v o gate up down
    expected = LAYERS * per_layer + r * (V + H) + r * (H + V)  # + embed_tokens (A: r x V, B: H x r) + lm_head
    peft_model = apply_lora(plain, lcfg(lora_dim=r))
    assert param_counts(peft_model) == (expected, n_base)
    assert expected == sum(t.numel() for t in adapter_state_dict(peft_model).values())


# -- the trainer mixin -------------------------------------------------------------------------------------------
class TinyLoraTrainer(LoraTrainerMixin, TorchModule):
    def setup(self):
        path = self.model_args["model_path"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).train()
        self.maybe_apply_lora()
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    def train_step(self, data_list, iteration):
        self.optimizer.zero_grad(set_to_none=True)
        ids = data_list[0]
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return {"loss": float(loss.detach())}


def trainer(path, out_dir, lora):
    mod = TinyLoraTrainer("policy")
    mod.bind(ModelConfig(num_cpu=1, trainable=True, args_dict={"model_path": path}, lora=lora),
             RuntimeConfig(output_dir=str(out_dir)), 0, seed=7)
    mod.setup()
    return mod


def batch(path, seed):
    return [torch.randint(4, vocab(path), (2, 8), generator=torch.Generator().manual_seed(seed))]


def clone_state(d):
    return copy.deepcopy(d)


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_mixin_lora_checkpoints_hold_adapters_and_one_base(tiny, tmp_path):
    lora = {"enable_lora": True, "lora_dim": 4, "lora_scaling": 2.0}
    mod = trainer(tiny, tmp_path, lora)
    assert mod.lora_enabled
    for seed in (0, 1):
        mod.train_step(batch(tiny, seed), 0)
    mod.save_checkpoint(1)
    saved = {"adapters": clone_state(adapter_state_dict(mod.model)), "opt": clone_state(mod.optimizer.state_dict()),
             "sched": clone_state(mod.scheduler.state_dict())}
    base_dir = os.path.join(mod.run_dir, "checkpoints", "policy", "base")
    assert mod.lora_base_dir() == base_dir and os.path.dirname(mod.checkpoint_dir(1)) == os.path.dirname(base_dir)
    base_file = os.path.join(base_dir, "model.safetensors")
    stamp = os.stat(base_file).st_mtime_ns, os.stat(base_file).st_ino
    ckpt = load_model_checkpoint(mod.checkpoint_dir(1))
    assert set(ckpt["weights"]) == set(adapter_state_dict(mod.model))  # adapters only
    assert ckpt["optimizer"] is not None and ckpt["scheduler"] is not None and ckpt["rng"] is not None
    base = load_model_checkpoint(base_dir)["weights"]
    assert set(base) == set(load(tiny).state_dict())  # safetensors stores keys sorted
    assert all(torch.equal(base[k], v) for k, v in load(tiny).state_dict().items())

    mod.train_step(batch(tiny, 2), 0)
    mod.save_checkpoint(2)
    assert (os.stat(base_file).st_mtime_ns, os.stat(base_file).st_ino) == stamp  # the base is written once
    assert sorted(os.listdir(os.path.dirname(base_dir))) == ["base", "iter_0000001", "iter_0000002"]

    fresh = trainer(tiny, tmp_path, lora)
    fresh.load_checkpoint(1)
    assert_same(adapter_state_dict(fresh.model), saved["adapters"])
    assert_same(fresh.optimizer.state_dict(), saved["opt"])
    assert_same(fresh.scheduler.state_dict(), saved["sched"])
    fresh.train_step(batch(tiny, 2), 0)  # the restored Adam moments give the same next step as the original
    assert_same(adapter_state_dict(fresh.model), adapter_state_dict(mod.model))

    info = fresh.info()
    n_base = sum(p.numel() for p in load(tiny).parameters())
    assert info["total_params"] == n_base
    assert info["trainable_params"] == sum(t.numel() for t in saved["adapters"].values()) < n_base

    other = trainer(tiny, tmp_path, lora)  # a base that differs from the saved one is refused
    with torch.no_grad():
        other.model.get_base_model().model.norm.weight.add_(1.0)
    with pytest.raises(CheckpointError, match="differs from this model's base"):
        other.load_checkpoint(1)
    os.rename(base_dir, base_dir + "-moved")
    with pytest.raises(CheckpointError, match="base of policy's LoRA checkpoints is missing"):
        trainer(tiny, tmp_path, lora).load_checkpoint(1)


def test_mixin_lora_weights_and_export_are_plain_merged_models(tiny, tmp_path):
    mod = trainer(tiny, tmp_path, {"enable_lora": True, "lora_dim": 4})
    mod.train_step(batch(tiny, 0), 0)
    merged = merged_state_dict(mod.model)
    weights = mod.get_weights()
    assert list(weights) == list(load(tiny).state_dict())
    assert all(torch.equal(weights[k], merged[k]) for k in merged)

    out = str(tmp_path / "export")
    for _ in range(2):  # a second export replaces the first
        assert mod.export_hf(out) == out
    assert not any(".tmp-" in n or ".old-" in n for n in os.listdir(tmp_path))
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    exported = AutoModelForCausalLM.from_pretrained(out)
    sd = exported.state_dict()
    assert list(sd) == list(merged) and all(torch.equal(sd[k], merged[k]) for k in merged)
    assert torch.allclose(logits(exported, tiny), logits(mod.model, tiny), atol=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("12+3").input_ids == mod.tokenizer("12+3").input_ids


def test_mixin_without_lora_behaves_like_torch_module(tiny, tmp_path):
    mod = trainer(tiny, tmp_path, {"enable_lora": False})
    assert not mod.lora_enabled and not hasattr(mod.model, "peft_config")
    mod.train_step(batch(tiny, 0), 0)
    assert_same(mod.get_weights(), mod.model.state_dict())
    mod.save_checkpoint(1)
    assert not os.path.exists(mod.lora_base_dir())
    assert set(load_model_checkpoint(mod.checkpoint_dir(1))["weights"]) == set(mod.model.state_dict())
    fresh = trainer(tiny, tmp_path, {"enable_lora": False})
    fresh.load_checkpoint(1)
    assert_same(fresh.model.state_dict(), mod.model.state_dict())
    assert_same(fresh.optimizer.state_dict(), mod.optimizer.state_dict())
    info = mod.info()
    assert info["trainable_params"] == info["total_params"] == sum(p.numel() for p in load(tiny).parameters())
    out = mod.export_hf(str(tmp_path / "export"))
    assert_same(AutoModelForCausalLM.from_pretrained(out).state_dict(), mod.model.state_dict())
