"""Models and data are checked before anything starts (`chatlearn.data.preflight`).

A `model_path` typo, a non-UTF-8 line or a prompt too long for the model is an error naming the config field
or the file and line, raised before the Prefect server, Ray or a flow run exist; the embedded tiny model is
built only at `tiny_model_path`, never at a path that merely does not exist.
"""

import json
import os

import pytest

from chatlearn.config import ConfigError, EngineChecks, load_config
from chatlearn.data.preflight import preflight
from chatlearn.data.prompts import DataError
from chatlearn.data.records import load_records
from tests.conftest import REPO

DEFAULT = os.path.join(REPO, "configs", "default.yaml")
DPO = os.path.join(REPO, "configs", "dpo.yaml")
CONTEXT = 64  # max_position_embeddings of the tiny Llama (configs/tiny_llama.yaml)


@pytest.fixture
def tiny(tiny_model_dir, monkeypatch):
    """The default configs' models all on the session's tiny Llama (already built)."""
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    return tiny_model_dir


def checked(tmp_path, *overrides, config=DEFAULT, engine=None):
    """preflight of `config` with `overrides` (output under tmp_path)."""
    from chatlearn.runtime.engines import resolve_engine  # torch-heavy: only the tests that resolve modules

    cfg = load_config(config, [f"runtime.output_dir={tmp_path / 'out'}", *overrides], [EngineChecks(engine)])
    return preflight(cfg, resolve_engine(cfg, None, engine))


def jsonl(path, prompts, **extra):
    path.write_text("".join(json.dumps({"prompt": p, **extra}) + "\n" for p in prompts))
    return path


def test_a_missing_model_path_names_the_field_and_builds_nothing_there(tiny, tmp_path):
    typo = tmp_path / "final" / "polcy"
    with pytest.raises(ConfigError) as err:
        checked(tmp_path, f"models.policy.args_dict.model_path={typo}")
    assert err.value.problems == [
        f"models.policy.args_dict.model_path: '{typo}' does not exist (a local Hugging Face model directory; the "
        "embedded tiny Llama is built only where model_path is args_dict.tiny_model_path)"]
    assert not typo.exists()  # the default's tiny_model spec did not turn the typo into a random model


def test_a_model_path_that_is_no_model_is_named_too(tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as err:
        checked(tmp_path, f"models.reference.args_dict.model_path={tmp_path / 'empty'}", "models.value.args_dict"
                f".model_path={tmp_path / 'empty' / 'x'}")
    assert [p.split(": ")[0] for p in err.value.problems] == ["models.reference.args_dict.model_path",
                                                              "models.value.args_dict.model_path"]
    assert "has no config.json: not a Hugging Face model directory" in err.value.problems[0]


def test_the_tiny_model_is_built_at_tiny_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", str(tmp_path / "tiny"))
    data = checked(tmp_path, "models.ppo_policy.args_dict.model_path=" + str(tmp_path / "tiny"))
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert len(data.prompts) == 4096 and len(data.eval_prompts) == 128


def test_a_non_utf8_line_is_a_data_error_at_its_line_without_the_file(tmp_path):
    f = tmp_path / "p.jsonl"
    body = "x" * 50_000
    f.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "\xff' + body.encode() + b'"}\n')
    with pytest.raises(DataError) as err:
        load_records(str(f), "prompt")
    msg = str(err.value)
    assert msg == f"{f}:3: not UTF-8 text (byte 13 of the line is 0xff: invalid start byte); save the file as UTF-8"
    assert body[:20] not in msg


def test_an_over_long_prompt_is_an_error_at_its_file_and_line(tiny, tmp_path):
    long = "max " + "1 " * 40 + "?"  # 85 characters: one token each with the character tokenizer, plus BOS
    data = jsonl(tmp_path / "long.jsonl", ["max 1 2 ?", long, "max 3 4 ?", long])
    with pytest.raises(DataError) as err:
        checked(tmp_path, f"runtime.data_path={data}")
    assert str(err.value) == (
        f"{data}:2: prompt of 86 tokens is longer than the 62 that fit (the model's context of {CONTEXT} tokens, "
        f"max_position_embeddings of {os.path.join(tiny, 'config.json')}, minus max_new_tokens 2); 1 more "
        "prompt(s) too long; shorten it, or set models.policy.args_dict.truncate_long_prompts=true to cut long "
        "prompts to fit (keeping their end)")


def test_truncate_long_prompts_cuts_them_to_fit_keeping_their_end(tiny, tmp_path):
    long = "max " + "1 " * 40 + "9 ?"
    data = jsonl(tmp_path / "long.jsonl", ["max 1 2 ?", long], answer="9")
    out = checked(tmp_path, f"runtime.data_path={data}", "models.policy.args_dict.truncate_long_prompts=true")
    assert [r["prompt"] for r in out.prompts] == ["max 1 2 ?", long[-(CONTEXT - 2 - 1):]]  # minus new tokens, BOS
    assert out.prompts[1]["answer"] == "9"


def test_a_dpo_pair_counts_its_longer_response(tiny, tmp_path):
    prompt = "max " + "1 " * 28 + "?"  # 61 characters: 62 tokens with BOS
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "max 1 ?", "chosen": "1", "rejected": "2"}) + "\n"
                     + json.dumps({"prompt": prompt, "chosen": "1", "rejected": "22"}) + "\n")
    with pytest.raises(DataError, match=r"pairs\.jsonl:2: prompt of 62 tokens is longer than the 61 that fit .*"
                                        r"minus its longer response and EOS, 3 tokens"):
        checked(tmp_path, f"runtime.data_path={pairs}", f"runtime.eval_data_path={pairs}", config=DPO)
    out = checked(tmp_path, f"runtime.data_path={pairs}", f"runtime.eval_data_path={pairs}",
                  "models.reference.args_dict.truncate_long_prompts=true", config=DPO)
    assert out.prompts[1]["prompt"] == prompt[-(CONTEXT - 3 - 1):]


def word_reward_model(path, context: int) -> str:
    """A tiny reward model of another tokenizer and context than the policy's: the tiny Llama's weights with
    `context` positions, and a word-level tokenizer (one token per word, BOS first) where the policy's counts
    characters."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from chatlearn.models.hf.tiny import SPECIAL_TOKENS, ensure_tiny_model

    ensure_tiny_model(path, {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                             "max_position_embeddings": context})
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + ["max", "?", *"0123456789"])}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)
    return str(path)


def test_a_reward_model_of_another_tokenizer_and_context_measures_prompts_its_own_way(tiny, tmp_path):
    reward = word_reward_model(tmp_path / "reward", context=16)
    as_model = ["models.reward.args_dict=" + json.dumps({"module": "chatlearn.models.hf.reward:ModelReward",
                                                         "model_path": reward})]
    nine = "max " + "1 " * 8 + "?"  # 10 words: 11 reward tokens with BOS (22 policy tokens: too many for 16 - 2)
    long = "max " + "1 " * 20 + "?"  # 22 words: 23 reward tokens (46 policy tokens: fits the policy's 64 - 2)
    data = jsonl(tmp_path / "p.jsonl", ["max 1 2 ?", nine, long])
    with pytest.raises(DataError) as err:
        checked(tmp_path, f"runtime.data_path={data}", *as_model)
    assert str(err.value) == (
        f"{data}:3: prompt of 23 tokens is longer than the 14 that fit (models.reward's context of 16 tokens, "
        f"max_position_embeddings of {os.path.join(reward, 'config.json')}, under its own tokenizer, minus "
        "max_new_tokens 2); shorten it, or set models.policy.args_dict.truncate_long_prompts=true to cut long "
        "prompts to fit (keeping their end)")
    # cut to fit the reward model (13 words after its BOS), keeping the end; the others untouched
    out = checked(tmp_path, f"runtime.data_path={data}", *as_model,
                  "models.policy.args_dict.truncate_long_prompts=true")
    assert [r["prompt"] for r in out.prompts] == ["max 1 2 ?", nine, "1 " * 12 + "?"]
    # the policy's max_new_tokens must leave the reward model room for a prompt too
    with pytest.raises(ConfigError) as err:
        checked(tmp_path, f"runtime.data_path={data}", *as_model, "models.policy.args_dict.max_new_tokens=16")
    assert err.value.problems == [
        f"models.policy.args_dict.max_new_tokens: 16 leaves no room for a prompt in models.reward's context of 16 "
        f"tokens (max_position_embeddings of {os.path.join(reward, 'config.json')}), which scores the response"]


@pytest.mark.parametrize("command,override,first_line", [
    ("train", "runtime.data_path={bad}", "chatlearn: bad data: {bad}:3: not UTF-8 text (byte 17 of the line is "
                                         "0xff: invalid start byte); save the file as UTF-8"),
    ("eval", "models.policy.args_dict.model_path={tmp}/final/polcy", "chatlearn: invalid config (1 problem(s)):"),
])
def test_the_command_exits_2_before_prefect_or_ray_start(command, override, first_line, tiny, tmp_path, monkeypatch,
                                                         capsys):
    import ray

    from chatlearn.cli import main
    from chatlearn.runtime.records import prefect_server

    def started(*_args, **_kwargs):
        raise AssertionError("the Prefect server was asked for")

    home = tmp_path / "prefect-home"
    home.mkdir()
    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(home))
    monkeypatch.setattr(prefect_server, "local_prefect_api", started)
    monkeypatch.setattr(ray, "init", started)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "max 1 ?"}\n{"prompt": "max 2 ?"}\n{"prompt": "max \xff' + b"9" * 10_000 + b'"}\n')
    names = {"bad": bad, "tmp": tmp_path}
    code = main([command, override.format(**names), f"runtime.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert lines[0] == first_line.format(**names)
    if command == "train":
        assert len(lines) == 1  # one line, not the file
    else:
        assert lines[1].startswith(f"  - models.policy.args_dict.model_path: '{tmp_path}/final/polcy' does not exist")
    assert os.listdir(home) == []  # no server.json: no Prefect server was started (ray.init would have raised)
    assert not (tmp_path / "out").exists()  # no run directory either


def mark_norm(model, tokenizer, seed):
    """A warm start that leaves a mark: the final norm's weight set to the seed."""
    assert tokenizer.eos_token_id is not None
    model.model.norm.weight.data.fill_(float(seed))


def test_a_warm_start_runs_on_the_random_init_before_the_model_is_saved_and_is_part_of_its_spec(tmp_path,
                                                                                                 monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from chatlearn.models.hf import tiny

    monkeypatch.setitem(tiny.WARM_STARTS, "calculator", "tests.test_preflight:mark_norm")
    spec = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "max_position_embeddings": 16,
            "seed": 7, "warm_start": "calculator"}
    path = tiny.ensure_tiny_model(tmp_path / "warm", spec)
    assert torch.equal(AutoModelForCausalLM.from_pretrained(path).model.norm.weight, torch.full((32,), 7.0))
    cold = tiny.ensure_tiny_model(tmp_path / "cold", {**spec, "warm_start": None})
    assert torch.equal(AutoModelForCausalLM.from_pretrained(cold).model.norm.weight, torch.ones(32))
    with pytest.raises(ValueError, match="built with a different spec"):  # not silently the other model
        tiny.ensure_tiny_model(tmp_path / "warm", {**spec, "warm_start": None})
    with pytest.raises(ConfigError) as err:
        checked(tmp_path, f"models.policy.args_dict.tiny_model_path={tmp_path / 'p'}",
                f"models.policy.args_dict.model_path={tmp_path / 'p'}",
                "models.policy.args_dict.tiny_model.warm_start=gsm8k")
    assert err.value.problems == ["models.policy.args_dict.tiny_model.warm_start: Input should be 'calculator'"]
    assert not (tmp_path / "p").exists()


def test_building_the_tiny_model_prints_no_progress_bar_and_leaves_them_as_they_were(tmp_path, capfd):
    # a user's first `chatlearn train` builds it in the driver: its terminal opened with transformers' bar of one
    # shard ("Writing model shards: 100%|...")
    from transformers.utils import logging as hf_logging

    from chatlearn.models.hf import tiny

    spec = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "max_position_embeddings": 16}
    assert hf_logging.is_progress_bar_enabled()
    tiny.ensure_tiny_model(tmp_path / "m", spec)
    out, err = capfd.readouterr()
    assert "shards" not in out + err and "\r" not in err, err
    assert hf_logging.is_progress_bar_enabled()  # a caller's own bars stay on
