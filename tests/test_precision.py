"""bf16 mixed precision (`args_dict.bf16`): a trainer keeps fp32 weights and optimizer state and computes its
layers in bf16, log-probs and losses in fp32; an inference copy holds bf16 weights and the sync sends it bf16."""

import pytest
import torch

from chatlearn.config import ConfigError, load_config
from chatlearn.config.engine_checks import EngineChecks
from chatlearn.models.hf.common import HFModelArgs
from chatlearn.models.hf.grpo_trainer import GRPOPolicyTrainer
from chatlearn.models.hf.policy import PolicyInference
from chatlearn.models.hf.ppo_trainer import PPOValueTrainer
from chatlearn.models.hf.value import ValueModel
from chatlearn.runtime.weights.param_sync import specs_of, transfer
from chatlearn.runtime.weights.sync import SyncError, SyncRoute, check_specs
from chatlearn.tasks.max_digit import make_records
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig
from tests.test_packing import micro_batches


def bound(cls, path: str, trainable: bool, **args):
    module = cls("ppo_policy" if trainable else "policy")
    module.bind(ModelConfig(num_cpu=1, trainable=trainable, args_dict={"model_path": path, "max_grad_norm": 1e9,
                                                                       **args}), RuntimeConfig(), 0, seed=7)
    module.setup()
    return module


def grpo_step(path: str, bf16: bool) -> tuple[GRPOPolicyTrainer, dict, dict, list]:
    trainer = bound(GRPOPolicyTrainer, path, True, bf16=bf16, kl_coef=0.1)
    seen: list[torch.dtype] = []
    trainer.model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.train_step(micro_batches(), 0)
    return trainer, stats, before, seen


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_qwen2_dir


def test_a_bf16_trainer_computes_in_bf16_and_keeps_fp32_weights_state_and_loss(model_dir):
    fp32, fp32_stats, _, fp32_seen = grpo_step(model_dir, bf16=False)
    bf16, bf16_stats, before, seen = grpo_step(model_dir, bf16=True)
    assert set(fp32_seen) == {torch.float32} and set(seen) == {torch.bfloat16}  # the LM head ran in bf16
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    states = [s for s in bf16.optimizer.state.values()]
    assert states and {t.dtype for s in states for k, t in s.items() if k != "step"} == {torch.float32}
    # the same step, the layers in bf16: close to the fp32 step's, and not equal to it
    assert bf16_stats["policy_loss"] == pytest.approx(fp32_stats["policy_loss"], rel=0.05, abs=1e-3)
    assert bf16_stats["policy_loss"] != fp32_stats["policy_loss"]
    moved = [n for n, p in bf16.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)  # AdamW stepped every fp32 master weight
    grads = {n: p.grad for n, p in fp32.model.named_parameters()}
    for n, p in bf16.model.named_parameters():
        assert p.grad.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), grads[n].flatten(), dim=0)
        assert cos > 0.95, n


def test_a_bf16_value_trainer_keeps_its_head_out_of_autocast(tiny_qwen2_dir):
    trainer = bound(PPOValueTrainer, tiny_qwen2_dir, True, bf16=True)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    values = trainer.model(micro_batches()[0], torch.device("cpu"))
    assert values.dtype == torch.float32


def test_a_bf16_inference_copy_holds_bf16_and_samples_with_fp32_logprobs(tiny_model_dir):
    policies = {bf16: bound(PolicyInference, tiny_model_dir, False, bf16=bf16, max_new_tokens=6) for bf16 in (0, 1)}
    assert {p.dtype for p in policies[1].model.parameters()} == {torch.bfloat16}
    outs = {}
    for bf16, policy in policies.items():
        batch = policy.collate_fn(policy.build_dataset(make_records(4, seed=2)))
        batch["sample_id"] = [0, 1, 2, 3]
        outs[bf16] = policy.forward_step(batch, 0)
    assert outs[1]["logprobs"].dtype == torch.float32
    value = bound(ValueModel, tiny_model_dir, False, bf16=True)
    assert value.model.value_head.weight.dtype == torch.float32
    assert {p.dtype for p in value.model.backbone.parameters()} == {torch.bfloat16}


def test_the_sync_sends_what_the_bf16_copy_holds(tiny_model_dir):
    trainer = bound(GRPOPolicyTrainer, tiny_model_dir, True, bf16=True)
    policy = bound(PolicyInference, tiny_model_dir, False, bf16=True)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)  # the trainer moved on
    route = SyncRoute(key="ppo_policy->policy", src="ppo_policy", dst="policy", src_ranks=["a"],
                      dst_ranks=[["a"]], members=[], collective=True)
    wire = lambda specs: [(n, list(s), str(d).removeprefix("torch.")) for n, s, d in specs]  # noqa: E731
    src, dst = trainer.sync_sources(), policy.sync_targets()
    specs = check_specs(route, wire(specs_of(src)), wire(specs_of(dst)))
    assert {d for _, _, d in specs} == {"bfloat16"}
    stats = transfer([(n, tuple(s), getattr(torch, d)) for n, s, d in specs], sources=src, targets=dst)
    assert stats["bytes"] == sum(t.numel() * 2 for t in dst.values())  # bf16 bytes, not fp32's
    for name, target in dst.items():
        assert torch.equal(target, src[name].to(torch.bfloat16)), name
    ints = [(n, s, "int64") for n, s, _ in wire(specs_of(dst))]
    with pytest.raises(SyncError, match="int64"):
        check_specs(route, wire(specs_of(src)), ints)


def test_bf16_refuses_a_non_fp32_dtype():
    with pytest.raises(ValueError, match="dtype must stay float32"):
        HFModelArgs(bf16=True, dtype="bfloat16")
    with pytest.raises(ConfigError) as err:
        load_config("configs/default.yaml", ["models.ppo_policy.args_dict.bf16=true",
                                             "models.ppo_policy.args_dict.dtype=bfloat16"], [EngineChecks()])
    assert any(p.startswith("models.ppo_policy.args_dict") and "dtype must stay float32" in p
               for p in err.value.problems), err.value.problems
