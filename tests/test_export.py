"""`chatlearn export` (issue 28): a checkpoint iteration of a run as a Hugging Face model or a peft adapter.

No Ray, no Prefect: the run directories are made by the real pieces of a run, in this process: the policy
trainer (`PPOPolicyTrainer`, LoRA or not) trains a few steps and writes its checkpoints where a run does
(`run_dir/checkpoints/ppo_policy/iter_N`), `record_start` writes `run_config.json` from a loaded config, and
`metrics.jsonl` holds one row per episode as a run writes it. The models are tiny (hidden 32, 2 layers).
"""

import json
import os
import re

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from chatlearn.checkpoint.dist_checkpoint import save_sharded
from chatlearn.checkpoint.model_checkpoint import load_model_checkpoint, save_model_checkpoint
from chatlearn.checkpoint.run_config import RunDirState, record_start
from chatlearn.cli import main
from chatlearn.config import load_config
from chatlearn.models.hf.export import ExportError, export_checkpoint
from chatlearn.models.hf.lora import adapter_state_dict
from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer
from chatlearn.models.hf.tiny import ensure_tiny_model

# peft 0.21 calls a transformers API that 5.x deprecates; nothing of ours
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

SPEC = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 32}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
LORA = {"enable_lora": True, "lora_dim": 4, "lora_scaling": 2.0}
# q/k/v of the second layer only: peft must record targets that select exactly these modules again on load
LORA_PART = {**LORA, "lora_layer": "ColumnParallelLinear", "column_only_qkv": True, "part_module_name": "layers.1."}


def micro_batches(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(4, 30, (2, 4), generator=g), "prompt_mask": torch.ones(2, 4),
             "response_ids": torch.randint(4, 30, (2, 3), generator=g), "response_mask": torch.ones(2, 3),
             "logprobs": -torch.rand(2, 3, generator=g) * 3, "advantages": torch.randn(2, 3, generator=g)}
            for _ in range(2)]


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 40, (3, 9), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids()).logits


def tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def make_run(root, model_path: str, lora: dict | None = None, iterations=(1, 2), exp="run") -> dict:
    """A run directory as a training run leaves it (see the module docstring); returns its pieces, with each
    iteration's weights as the trainer held them (the full state dict; with LoRA the merged weights)."""
    overrides = [f"runtime.output_dir={root}", f"runtime.exp_name={exp}",
                 f"models.ppo_policy.args_dict.model_path={model_path}", "models.ppo_policy.args_dict.lr=0.01",
                 *(f"models.ppo_policy.lora.{k}={v}" for k, v in (lora or {}).items())]
    cfg = load_config(None, overrides)
    record_start(cfg, RunDirState(None))
    trainer = PPOPolicyTrainer("ppo_policy")
    trainer.bind(cfg.models["ppo_policy"], cfg.runtime, 0, seed=7)
    trainer.setup()
    weights, rows = {}, []
    for episode, it in enumerate(iterations):
        trainer.train_step(micro_batches(it), it)
        trainer.save_checkpoint(it)
        weights[it] = clone(trainer.get_weights())
        rows.append({"episode": episode + 1, "reward_mean": 0.25 * (episode + 1), "policy_loss": -0.1 * it,
                     "iteration": it, "stage_seconds": {"train": 1.5}})
    with open(os.path.join(cfg.runtime.run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return {"dir": cfg.runtime.run_dir, "trainer": trainer, "weights": weights, "rows": rows, "path": model_path}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(ensure_tiny_model(tmp_path_factory.mktemp("export") / "llama", SPEC))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    spec = {**SPEC, "architecture": "qwen2", "tie_word_embeddings": True}
    return str(ensure_tiny_model(tmp_path_factory.mktemp("export") / "qwen2", spec))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, llama):
    return make_run(tmp_path_factory.mktemp("runs"), llama)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, llama):
    return make_run(tmp_path_factory.mktemp("runs"), llama, LORA)


def run_cli(capsys, *args):
    """`chatlearn export ARGS` in this process: (exit code, stdout, stderr) of the command alone."""
    capsys.readouterr()  # what came before (a trainer's loading bar) is not the command's
    code = main(["export", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def card(out) -> tuple[dict, str]:
    text = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    front = yaml.safe_load(text.split("---\n")[1])
    return front, text


# -- --to hf ----------------------------------------------------------------------------------------------------
def test_hf_export_of_a_full_checkpoint_is_its_weights_bit_for_bit(full_run, tmp_path, capsys):
    code, out, err = run_cli(capsys, full_run["dir"], tmp_path / "hf")
    assert (code, err) == (0, "")
    assert out == f"exported ppo_policy iteration 2 of {full_run['dir']} as a Hugging Face model: {tmp_path / 'hf'}\n"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    saved = load_model_checkpoint(os.path.join(full_run["dir"], "checkpoints", "ppo_policy", "iter_0000002"))
    state = model.state_dict()
    assert state.keys() == saved["weights"].keys()
    assert all(torch.equal(state[k], v) for k, v in saved["weights"].items())
    assert torch.equal(logits(model), logits(full_run["trainer"].model))  # the trainer's model, exactly
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("12+3").input_ids == full_run["trainer"].tokenizer("12+3").input_ids
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing left beside it


def test_an_earlier_iteration_exports_that_iterations_weights(full_run, tmp_path):
    assert export_checkpoint(full_run["dir"], str(tmp_path / "it1"), iteration=1) == str(tmp_path / "it1")
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "it1").state_dict()
    first, last = full_run["weights"][1], full_run["weights"][2]
    assert all(torch.equal(state[k], v) for k, v in first.items())
    assert not all(torch.equal(state[k], v) for k, v in last.items())
    front, text = card(tmp_path / "it1")
    assert "# run: ppo_policy, iteration 1" in text
    assert "trainer iteration 1: episode 1 of the run" in text


@pytest.mark.parametrize("lora", [LORA, LORA_PART], ids=["every-layer", "part-qkv"])
def test_a_lora_checkpoint_exports_merged_and_as_a_peft_adapter(lora, llama, tmp_path):
    run = make_run(tmp_path / "runs", llama, lora)
    trainer = run["trainer"]
    export_checkpoint(run["dir"], str(tmp_path / "hf"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = trainer.get_weights()  # what the run's sync sends: the merged weights
    state = merged.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], v) for k, v in want.items())
    final = AutoModelForCausalLM.from_pretrained(trainer.export_hf(str(tmp_path / "final")))  # the run's final/policy
    assert all(torch.equal(state[k], v) for k, v in final.state_dict().items())
    assert not os.path.exists(tmp_path / "hf" / "adapter_config.json")

    export_checkpoint(run["dir"], str(tmp_path / "peft"), to="peft")
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(os.listdir(tmp_path / "peft"))
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        assert all(".lora_" in k for k in f.keys())  # adapters only, no copy of the embeddings
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), str(tmp_path / "peft"))
    trained = {k.replace(".default", "") for k in adapter_state_dict(trainer.model)}
    loaded = {k.replace(".default", "") for k in adapter_state_dict(adapter)}
    assert loaded == trained  # the same modules adapted, no more
    assert torch.allclose(logits(adapter), logits(merged), atol=1e-5, rtol=0)
    assert torch.allclose(logits(adapter), logits(trainer.model), atol=1e-5, rtol=0)
    front, text = card(tmp_path / "peft")
    assert front["library_name"] == "peft" and front["base_model"] == llama and "lora" in front["tags"]
    assert "PeftModel.from_pretrained(base, \"THIS_DIRECTORY\")" in text
    assert json.load(open(tmp_path / "peft" / "adapter_config.json"))["base_model_name_or_path"] == llama


def test_an_earlier_lora_iteration_exports_its_adapters(lora_run, tmp_path):
    export_checkpoint(lora_run["dir"], str(tmp_path / "it1"), iteration=1)
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "it1").state_dict()
    assert all(torch.equal(state[k], v) for k, v in lora_run["weights"][1].items())
    assert not all(torch.equal(state[k], v) for k, v in lora_run["weights"][2].items())


# -- the model card ---------------------------------------------------------------------------------------------
def test_the_model_card_holds_the_run_the_iterations_metrics_and_the_config(full_run, tmp_path):
    out = export_checkpoint(full_run["dir"], str(tmp_path / "card"), iteration=2)
    front, text = card(out)
    assert front == {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": ["chatlearn", "rlhf"]}
    assert "# run: ppo_policy, iteration 2" in text and f"`{full_run['dir']}`" in text
    assert "episode 2 of the run" in text
    assert 'AutoModelForCausalLM.from_pretrained("THIS_DIRECTORY")' in text
    table = dict(re.findall(r"^\| (\S+) \| (.+) \|$", text.split("## Metrics of iteration 2")[1], re.M))
    row = full_run["rows"][1]
    assert table.pop("metric") == "value"
    assert {k: json.loads(v) for k, v in table.items()} == {
        "episode": 2, "reward_mean": row["reward_mean"], "policy_loss": row["policy_loss"], "iteration": 2,
        "stage_seconds.train": 1.5}
    config = yaml.safe_load(text.split("```yaml\n")[1].split("```")[0])
    record = json.load(open(os.path.join(full_run["dir"], "run_config.json")))
    assert config == record["config"]
    assert config["models"]["ppo_policy"]["args_dict"]["lr"] == 0.01


def test_the_card_says_when_metrics_jsonl_has_no_row_for_the_iteration(full_run, tmp_path, monkeypatch):
    metrics = os.path.join(full_run["dir"], "metrics.jsonl")
    kept = open(metrics).read()
    try:
        with open(metrics, "w") as f:
            f.write(kept.splitlines()[0] + "\n{\"episode\": 1, \"iter")  # iteration 2's row cut short by a kill
        _, text = card(export_checkpoint(full_run["dir"], str(tmp_path / "card")))
    finally:
        with open(metrics, "w") as f:
            f.write(kept)
    assert "metrics.jsonl has no row with `iteration: 2`." in text
    assert "no episode of metrics.jsonl has this iteration" in text


# -- tied embeddings, sharded checkpoints -----------------------------------------------------------------------
@pytest.mark.parametrize("lora", [None, {**LORA, "lora_layer": "ColumnParallelLinear,RowParallelLinear"}],
                         ids=["full", "lora"])
def test_a_tied_model_exports_and_reloads_tied(lora, qwen2, tmp_path):
    run = make_run(tmp_path / "runs", qwen2, lora, iterations=(1,))
    out = export_checkpoint(run["dir"], str(tmp_path / "hf"))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert HEAD not in f.keys()  # stored once
    model = AutoModelForCausalLM.from_pretrained(out)
    assert tied(model)
    want = run["weights"][1]
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.lm_head.weight, want[HEAD])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process, as meant
def test_a_sharded_checkpoint_exports_its_weights(qwen2, tmp_path):
    run = make_run(tmp_path / "runs", qwen2, iterations=(1,))
    trainer = run["trainer"]
    trainer.train_step(micro_batches(5), 2)
    path = os.path.join(run["dir"], "checkpoints", "ppo_policy", "iter_0000002")
    save_sharded(path, trainer.model, trainer.optimizer, trainer.scheduler, None, meta={"iteration": 2})
    out = export_checkpoint(run["dir"], str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(out)
    want = trainer.model.state_dict()
    assert tied(model) and all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


# -- where the model config and tokenizer come from -------------------------------------------------------------
def test_without_the_runs_model_path_the_final_policy_or_model_path_gives_the_config(llama, tmp_path, capsys):
    import shutil

    copy = str(tmp_path / "base")
    shutil.copytree(llama, copy)
    run = make_run(tmp_path / "runs", copy, iterations=(1,))
    shutil.rmtree(copy)
    code, _, err = run_cli(capsys, run["dir"], tmp_path / "a")
    assert code == 1 and err == (
        f"chatlearn: error: {run['dir']}: cannot find ppo_policy's model config and tokenizer: "
        f"models.ppo_policy.args_dict.model_path '{copy}' is not a Hugging Face model directory from here "
        "and the run has no final/policy; run from the directory the run was started in, or give --model-path DIR "
        "(the model the run trained)\n")
    assert run_cli(capsys, run["dir"], tmp_path / "a", "--model-path", llama)[0] == 0
    run["trainer"].export_hf(os.path.join(run["dir"], "final", "policy"))
    assert run_cli(capsys, run["dir"], tmp_path / "b")[0] == 0
    for out in ("a", "b"):
        state = AutoModelForCausalLM.from_pretrained(tmp_path / out).state_dict()
        assert all(torch.equal(state[k], v) for k, v in run["weights"][1].items())


# -- refusals: one line each, nothing written -------------------------------------------------------------------
def test_bad_input_is_one_line_and_writes_nothing(full_run, tmp_path, capsys):
    run = full_run["dir"]
    out = tmp_path / "out"
    empty_run = tmp_path / "fresh"
    empty_run.mkdir()
    (empty_run / "run_config.json").write_text(open(os.path.join(run, "run_config.json")).read())
    cases = [
        ((tmp_path / "nowhere", out), f"{tmp_path / 'nowhere'}: no such run directory"),
        ((tmp_path, out), f"{tmp_path}: not a run directory (no run_config.json)"),
        ((empty_run, out), f"{empty_run}: no model checkpoints (nothing under {empty_run / 'checkpoints'}); the run "
                           "saved none yet"),
        ((run, out, "--iteration", 7), f"{run}: ppo_policy has no checkpoint of iteration 7; there are: 1, 2"),
        ((run, out, "--model", "ppo_value"), f"{run}: no checkpoints of model 'ppo_value'; there are: ppo_policy"),
        ((run, out, "--to", "peft"), f"{run}: ppo_policy was trained without LoRA (models.ppo_policy.lora."
                                     "enable_lora: false), so it has no adapter to export as peft; --to hf exports "
                                     "the model"),
        ((run, run, "--force"), f"{run}: refusing to export into the run directory's own files ({run}); choose "
                                "another OUT"),
        ((run, os.path.join(run, "checkpoints", "x")), f"{os.path.join(run, 'checkpoints', 'x')}: refusing to "
                                                        f"export into the run directory's own files ({run}); choose "
                                                        "another OUT"),
    ]
    for args, message in cases:
        code, stdout, err = run_cli(capsys, *args)
        assert (code, stdout, err) == (1, "", f"chatlearn: error: {message}\n"), args
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["fresh"]


def test_an_output_in_the_way_is_refused_unless_forced(full_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert run_cli(capsys, full_run["dir"], out) == (
        1, "", f"chatlearn: error: {out} exists and is not empty; --force replaces it\n")
    assert os.listdir(out) == ["mine.txt"]
    (tmp_path / "file").write_text("x")
    assert run_cli(capsys, full_run["dir"], tmp_path / "file", "--force")[2] == \
        f"chatlearn: error: {tmp_path / 'file'} exists and is not a directory\n"
    assert run_cli(capsys, full_run["dir"], out, "--force")[0] == 0
    assert "mine.txt" not in os.listdir(out) and "config.json" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["file", "out"]


def test_a_corrupted_checkpoint_is_named_and_nothing_is_written(llama, tmp_path, capsys):
    run = make_run(tmp_path / "runs", llama, iterations=(1,))
    weights = os.path.join(run["dir"], "checkpoints", "ppo_policy", "iter_0000001", "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\1\2\3")
    assert run_cli(capsys, run["dir"], tmp_path / "out") == (
        1, "", f"chatlearn: error: {weights}: checksum mismatch, the file is corrupt\n")
    assert not (tmp_path / "out").exists()


def test_a_lora_checkpoint_without_its_base_is_named(llama, tmp_path, capsys):
    run = make_run(tmp_path / "runs", llama, LORA, iterations=(1,))
    base = os.path.join(run["dir"], "checkpoints", "ppo_policy", "base")
    os.rename(base, base + "-moved")
    assert run_cli(capsys, run["dir"], tmp_path / "out") == (
        1, "", f"chatlearn: error: {base}: the frozen base of ppo_policy's LoRA checkpoints is missing\n")


def test_several_trained_models_without_ppo_policy_need_model(full_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(full_run["dir"], run)
    checkpoints = run / "checkpoints"
    os.rename(checkpoints / "ppo_policy", checkpoints / "actor")
    shutil.copytree(checkpoints / "actor", checkpoints / "critic")
    with pytest.raises(ExportError, match=r"checkpoints of several models \(actor, critic\); choose one with --model"):
        export_checkpoint(str(run), str(tmp_path / "out"))
    shutil.rmtree(checkpoints / "critic")
    with pytest.raises(ExportError, match="the run's config has no model 'actor', so its model_path is not a"):
        export_checkpoint(str(run), str(tmp_path / "out"))
    out = export_checkpoint(str(run), str(tmp_path / "out"), model_path=full_run["path"])  # the only trained model
    assert "# run: actor, iteration 2" in card(out)[1]


def test_a_model_that_is_not_a_causal_lm_is_refused(full_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(full_run["dir"], run)
    value = run / "checkpoints" / "ppo_value" / "iter_0000002"
    save_model_checkpoint(str(value), {"head.weight": torch.zeros(1, 32)}, meta={"model": "ppo_value"})
    with pytest.raises(ExportError, match=re.escape(
            f"{value}: its weights do not fit the causal LM at {full_run['path']} (")) as refused:
        export_checkpoint(str(run), str(tmp_path / "out"), model="ppo_value", model_path=full_run["path"])
    assert "unexpected, e.g. ['head.weight']): ppo_value is not a causal LM of that architecture" in str(refused.value)
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_write_that_fails_leaves_the_previous_output_and_no_temporary_directory(full_run, tmp_path, monkeypatch,
                                                                                   capsys):
    from transformers import PreTrainedTokenizerBase

    out = export_checkpoint(full_run["dir"], str(tmp_path / "out"), iteration=1)
    before = open(os.path.join(out, "README.md")).read()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_disk)
    assert run_cli(capsys, full_run["dir"], out, "--force") == (
        1, "", f"chatlearn: error: cannot write the export to {out}: [Errno 28] No space left on device\n")
    assert open(os.path.join(out, "README.md")).read() == before
    assert sorted(os.listdir(tmp_path)) == ["out"]
