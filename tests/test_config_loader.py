"""YAML loading: includes, ${ENV} values, model config files, overrides, and ChatLearn's own configs."""

import os
import textwrap
import warnings
from pathlib import Path

import pytest

from chatlearn.config import ConfigError, ConfigWarning, load_config, load_config_dict, load_yaml_with_includes
from chatlearn.config.envvars import parse_value
from chatlearn.config.loader import configs_dir, deep_merge


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def quiet_load(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(*args, **kwargs)


# ---------------------------------------------------------------- includes


def test_include_precedence_chatlearn_example(tmp_path):
    # chatlearn.md 5.3 item 1: later includes override earlier ones; the including file overrides all.
    write(tmp_path / "base.yaml", "generate_config:\n  eos_token_id: 102\n  top_k: 1\n")
    write(
        tmp_path / "base2.yaml",
        "test: 123\nmodel_config:\n  attention_probs_dropout_prob: 0.3\n"
        "generate_config:\n  eos_token_id: 103\n",
    )
    main = write(
        tmp_path / "model.yaml",
        "includes:\n  - base.yaml\n  - base2.yaml\nmodel_config:\n  attention_probs_dropout_prob: 0.1\n",
    )
    data = load_yaml_with_includes(main)
    assert data == {
        "generate_config": {"eos_token_id": 103, "top_k": 1},
        "test": 123,
        "model_config": {"attention_probs_dropout_prob": 0.1},
    }


def test_nested_includes_resolve_against_main_config_dir(tmp_path):
    write(tmp_path / "a.yaml", "x: 1\ny: 1\nz: 1\n")
    write(tmp_path / "b.yaml", "includes: a.yaml\ny: 2\n")  # a single string is accepted too
    write(tmp_path / "sub" / "c.yaml", "includes: [b.yaml]\nz: 3\n")  # b.yaml is next to the main file
    main = write(tmp_path / "main.yaml", "includes:\n  - sub/c.yaml\nw: 4\n")
    assert load_yaml_with_includes(main) == {"x": 1, "y": 2, "z": 3, "w": 4}


def test_include_falls_back_to_including_files_dir(tmp_path):
    write(tmp_path / "sub" / "inner.yaml", "v: inner\n")
    write(tmp_path / "sub" / "outer.yaml", "includes: [inner.yaml]\n")
    main = write(tmp_path / "main.yaml", "includes: [sub/outer.yaml]\n")
    assert load_yaml_with_includes(main) == {"v": "inner"}


def test_absolute_include(tmp_path):
    other = write(tmp_path / "elsewhere" / "abs.yaml", "k: 5\n")
    main = write(tmp_path / "cfg" / "main.yaml", f"includes: [{other}]\nj: 6\n")
    assert load_yaml_with_includes(main) == {"k": 5, "j": 6}


def test_missing_include_names_file_and_includer(tmp_path):
    main = write(tmp_path / "main.yaml", "includes: [nope.yaml]\n")
    with pytest.raises(ConfigError) as info:
        load_yaml_with_includes(main)
    assert "nope.yaml" in str(info.value)
    assert str(main) in str(info.value)


def test_include_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "includes: [b.yaml]\n")
    write(tmp_path / "b.yaml", "includes: [a.yaml]\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_yaml_with_includes(tmp_path / "a.yaml")


def test_diamond_include_is_not_a_cycle(tmp_path):
    write(tmp_path / "base.yaml", "v: 1\n")
    write(tmp_path / "l.yaml", "includes: [base.yaml]\nl: 1\n")
    write(tmp_path / "r.yaml", "includes: [base.yaml]\nr: 1\n")
    main = write(tmp_path / "main.yaml", "includes: [l.yaml, r.yaml]\n")
    assert load_yaml_with_includes(main) == {"v": 1, "l": 1, "r": 1}


def test_main_config_includes_runtime_sections(tmp_path):
    write(tmp_path / "common.yaml", "runtime:\n  num_episode: 9\n  sample_per_episode: 64\n")
    main = write(
        tmp_path / "main.yaml",
        "includes: [common.yaml]\nruntime:\n  num_episode: 3\nmodels:\n  policy:\n    num_gpu: 1\n",
    )
    cfg = load_config(main)
    assert cfg.runtime.num_episode == 3
    assert cfg.runtime.sample_per_episode == 64


# ---------------------------------------------------------------- env vars


def test_env_var_default_and_set(tmp_path, monkeypatch):
    main = write(
        tmp_path / "main.yaml",
        "runtime:\n  num_training_epoch: ${num_training_epoch:3}\nmodels:\n  p:\n    num_gpu: 1\n",
    )
    monkeypatch.delenv("num_training_epoch", raising=False)
    assert load_config(main).runtime.num_training_epoch == 3
    monkeypatch.setenv("num_training_epoch", "2")
    assert load_config(main).runtime.num_training_epoch == 2


def test_env_var_without_default_is_none_with_warning(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_TEST_DATA", raising=False)
    main = write(tmp_path / "main.yaml", "runtime:\n  data_path: ${CL_TEST_DATA}\n")
    with pytest.warns(ConfigWarning, match=r"CL_TEST_DATA.*runtime\.data_path"):
        cfg = load_config(main)
    assert cfg.runtime.data_path is None
    monkeypatch.setenv("CL_TEST_DATA", "/data/x.jsonl")
    assert load_config(main).runtime.data_path == "/data/x.jsonl"


def test_env_values_are_parsed_as_literals(tmp_path, monkeypatch):
    for name in ("CL_A", "CL_B", "CL_C", "CL_D", "CL_E", "CL_F", "CL_G"):
        monkeypatch.delenv(name, raising=False)
    main = write(
        tmp_path / "m.yaml",
        """
        a: ${CL_A:4}
        b: ${CL_B:True}
        c: ${CL_C:1e-5}
        d: ${CL_D:[1,2]}
        e: ${CL_E:null}
        f: ${CL_F:None}
        g: ${CL_G:hello}
        """,
    )
    assert load_yaml_with_includes(main) == {
        "a": 4,
        "b": True,
        "c": 1e-5,
        "d": [1, 2],
        "e": None,
        "f": None,
        "g": "hello",
    }
    monkeypatch.setenv("CL_A", "2.5")
    monkeypatch.setenv("CL_B", "false")
    monkeypatch.setenv("CL_G", "007")
    data = load_yaml_with_includes(main)
    assert (data["a"], data["b"], data["g"]) == (2.5, False, "007")


def test_env_vars_in_nested_dicts_and_lists(tmp_path, monkeypatch):
    monkeypatch.setenv("CL_ITEM", "7")
    monkeypatch.delenv("CL_MISSING", raising=False)
    main = write(
        tmp_path / "m.yaml",
        "outer:\n  inner:\n    v: ${CL_ITEM}\n"
        "  items:\n    - ${CL_ITEM}\n    - ${CL_MISSING:x}\n    - ['${CL_ITEM:0}']\n",
    )
    assert load_yaml_with_includes(main) == {"outer": {"inner": {"v": 7}, "items": [7, "x", [7]]}}


def test_default_may_contain_colons(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_URL", raising=False)
    main = write(tmp_path / "m.yaml", "url: ${CL_URL:http://host:8080/path}\n")
    assert load_yaml_with_includes(main) == {"url": "http://host:8080/path"}


def test_embedded_env_var_is_text(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_USER", raising=False)
    monkeypatch.setenv("CL_RUN", "42")
    main = write(tmp_path / "m.yaml", "a: runs/${CL_USER:me}/x\nb: id-${CL_RUN}\nc: ${CL_RUN}${CL_RUN}\n")
    assert load_yaml_with_includes(main) == {"a": "runs/me/x", "b": "id-42", "c": "4242"}
    monkeypatch.setenv("CL_USER", "bob")
    assert load_yaml_with_includes(main)["a"] == "runs/bob/x"


def test_unquoted_exponent_numbers_are_floats(tmp_path):
    main = write(tmp_path / "m.yaml", "lr: 1e-5\neps: 1E-12\nbig: 2e3\nq: '1e-5'\nv: 4.22.0\n")
    assert load_yaml_with_includes(main) == {
        "lr": 1e-5,
        "eps": 1e-12,
        "big": 2000.0,
        "q": "1e-5",
        "v": "4.22.0",
    }


@pytest.mark.parametrize(
    "text,value",
    [
        ("4", 4),
        ("-1", -1),
        ("True", True),
        ("false", False),
        ("1e-5", 1e-5),
        ("2.4e-7", 2.4e-7),
        ("[1,2]", [1, 2]),
        ("null", None),
        ("None", None),
        ("abc", "abc"),
        ("<EOS>;</s>", "<EOS>;</s>"),
        ("yes", "yes"),
        ("", ""),
        ("[policy,reference]", ["policy", "reference"]),
        ("{a: 1}", {"a": 1}),
        ("a: b", "a: b"),
        ("'recompute'", "recompute"),  # ChatLearn's literal_eval strips the quotes
        ('"full"', "full"),
        ("'unterminated", "'unterminated"),  # not a string literal: kept as written
    ],
)
def test_parse_value(text, value):
    assert parse_value(text) == value
    assert type(parse_value(text)) is type(value)


def test_deep_merge_does_not_mutate():
    base = {"a": {"b": 1, "c": 2}, "l": [1]}
    out = deep_merge(base, {"a": {"c": 3}, "l": [2]})
    assert out == {"a": {"b": 1, "c": 3}, "l": [2]}
    assert base == {"a": {"b": 1, "c": 2}, "l": [1]}


# ---------------------------------------------------------------- model config files


def _model_files(tmp_path):
    write(tmp_path / "shared.yaml", "hidden_size: 64\nlr: 1e-4\ntensor_model_parallel_size: 2\n")
    write(tmp_path / "policy.yaml", "includes: [shared.yaml]\nlr: 2e-4\ntemperature: ${CL_TEMP:0.7}\n")
    return write(
        tmp_path / "rlhf.yaml",
        """
        models:
          policy:
            model_config_file: policy.yaml
            num_gpu: 4
            tensor_model_parallel_size: 1
            args_dict:
              hidden_size: 128
        runtime:
          sample_per_episode: 64
        """,
    )


def test_model_config_file_becomes_args_dict_and_overrides_tp(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_TEMP", raising=False)
    cfg = load_config(_model_files(tmp_path))
    policy = cfg.models["policy"]
    assert policy.args_dict == {
        "hidden_size": 128,
        "lr": 2e-4,
        "tensor_model_parallel_size": 2,
        "temperature": 0.7,
    }
    assert policy.tensor_model_parallel_size == 2  # from the file, over the YAML field
    assert policy.num_replica == 2
    assert policy.config_dir == str(tmp_path)


def test_model_config_file_missing(tmp_path):
    main = write(
        tmp_path / "m.yaml", "models:\n  policy:\n    num_gpu: 1\n    model_config_file: gone.yaml\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(main)
    assert info.value.problems == [
        f"models.policy.model_config_file: file not found: {tmp_path / 'gone.yaml'} (nor "
        f"{configs_dir() / 'gone.yaml'})"
    ]


def test_includes_and_model_config_files_follow_one_rule(tmp_path, monkeypatch):
    """A file name a config gives is looked up beside the main config, then beside the file that names it, then
    (a bare name) among the packaged configs: the same for an include and for a model_config_file."""
    monkeypatch.chdir(tmp_path)
    own = tmp_path / "mine"
    # one's own config, outside the repository, including a packaged config and naming a packaged model file
    mine = write(own / "run.yaml", "includes: [grpo.yaml]\nmodels:\n  policy:\n    model_config_file: "
                                   "tiny_qwen2.yaml\n")
    cfg = load_config(mine)
    assert cfg.models["policy"].args_dict["tiny_model"]["architecture"] == "qwen2"
    # what the included packaged config names itself comes from the package too
    assert cfg.models["reference"].model_config_file == str(configs_dir() / "tiny_llama.yaml")
    # a file of that name beside one's own config wins, for both kinds, wherever the name is written
    write(own / "tiny_qwen2.yaml", "hidden_size: 24\n")
    write(own / "tiny_llama.yaml", "hidden_size: 16\n")
    write(own / "grpo.yaml", "includes: [" + str(configs_dir() / "grpo.yaml") + "]\n"
                             "runtime:\n  exp_name: from_beside\n")
    cfg = load_config(mine)
    assert cfg.runtime.exp_name == "from_beside"
    assert cfg.models["policy"].args_dict["hidden_size"] == 24 and "tiny_model" not in cfg.models["policy"].args_dict
    assert cfg.models["reference"].args_dict == {"hidden_size": 16}
    # an include's own folder comes after the main config's, for its includes and its model files alike
    write(tmp_path / "lib" / "base.yaml", "includes: [part.yaml]\nmodels:\n  policy:\n    num_cpu: 1\n"
                                          "    model_config_file: model.yaml\n")
    write(tmp_path / "lib" / "part.yaml", "runtime:\n  exp_name: lib_part\n")
    write(tmp_path / "lib" / "model.yaml", "hidden_size: 8\n")
    main = write(own / "two.yaml", "includes: [../lib/base.yaml]\n")
    cfg = load_config(main)
    assert (cfg.runtime.exp_name, cfg.models["policy"].args_dict) == ("lib_part", {"hidden_size": 8})
    write(own / "part.yaml", "runtime:\n  exp_name: main_part\n")
    write(own / "model.yaml", "hidden_size: 12\n")
    cfg = load_config(main)
    assert (cfg.runtime.exp_name, cfg.models["policy"].args_dict) == ("main_part", {"hidden_size": 12})


def test_model_config_file_pp_and_zero_override(tmp_path):
    write(tmp_path / "m.yaml", "pipeline_model_parallel_size: 2\nzero_size: 1\n")
    main = write(
        tmp_path / "c.yaml",
        "models:\n  p:\n    model_config_file: m.yaml\n    num_gpu: 8\n    pipeline_model_parallel_size: 4\n",
    )
    p = load_config(main).models["p"]
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.zero_size, p.num_replica) == (
        1,
        2,
        1,
        4,
    )


# ---------------------------------------------------------------- overrides


def test_overrides_win_over_files_and_includes(tmp_path):
    write(tmp_path / "inc.yaml", "runtime:\n  num_episode: 11\n  exp_name: from_include\n")
    main = write(
        tmp_path / "main.yaml",
        "includes: [inc.yaml]\nruntime:\n  num_episode: 5\n"
        "models:\n  policy:\n    num_gpu: 2\n  ref:\n    num_gpu: 2\n",
    )
    cfg = load_config(
        main,
        [
            "runtime.num_episode=3",
            "runtime.exp_name=cli",
            "models.policy.num_gpu=0",
            "models.policy.num_cpu=1",
            "runtime.colocation=[policy,ref]",
            "runtime.new_key=1e-3",
        ],
    )
    assert cfg.runtime.num_episode == 3
    assert cfg.runtime.exp_name == "cli"
    assert cfg.runtime.output_dir == os.path.join("./", "cli")
    assert (cfg.models["policy"].num_gpu, cfg.models["policy"].num_cpu) == (0, 1)
    assert cfg.runtime.colocation == ["policy", "ref"]
    assert cfg.runtime.get("new_key") == 1e-3


def test_override_colocation_single_group(tmp_path):
    main = write(tmp_path / "m.yaml", "models:\n  a:\n    num_gpu: 1\n  b:\n    num_gpu: 1\n")
    cfg = load_config(main, ['runtime.colocation=["a,b"]'])
    assert cfg.runtime.colocation_groups == [["a", "b"]]


def test_overrides_win_over_model_config_file(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_TEMP", raising=False)
    cfg = load_config(
        _model_files(tmp_path),
        [
            "models.policy.args_dict.lr=1e-4",
            "models.policy.args_dict.temperature=1",
            "models.policy.num_gpu=8",
        ],
    )
    policy = cfg.models["policy"]
    assert policy.args_dict["lr"] == 1e-4
    assert policy.args_dict["temperature"] == 1
    assert (policy.num_gpu, policy.tensor_model_parallel_size, policy.num_replica) == (8, 2, 4)


def test_tp_override_beats_model_config_file_and_stays_consistent(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_TEMP", raising=False)
    cfg = load_config(_model_files(tmp_path), ["models.policy.tensor_model_parallel_size=4"])
    policy = cfg.models["policy"]
    assert policy.tensor_model_parallel_size == 4
    assert policy.args_dict["tensor_model_parallel_size"] == 4
    assert policy.num_replica == 1
    cfg = load_config(_model_files(tmp_path), ["models.policy.args_dict.tensor_model_parallel_size=1"])
    assert cfg.models["policy"].tensor_model_parallel_size == 1


def test_override_can_name_another_model_config_file(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_TEMP", raising=False)
    write(tmp_path / "other.yaml", "lr: 5e-6\n")
    cfg = load_config(_model_files(tmp_path), ["models.policy.model_config_file=other.yaml"])
    assert cfg.models["policy"].args_dict == {"lr": 5e-6, "hidden_size": 128}
    assert cfg.models["policy"].tensor_model_parallel_size == 1


def test_malformed_override(tmp_path):
    main = write(tmp_path / "m.yaml", "models:\n  p:\n    num_gpu: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(main, ["runtime.num_episode", "runtime.num_episode=2"])
    assert info.value.problems == ["overrides: 'runtime.num_episode' is not of the form dotted.key=value"]


def test_override_through_a_scalar_is_an_error(tmp_path):
    main = write(tmp_path / "m.yaml", "runtime:\n  num_episode: 2\n")
    with pytest.raises(ConfigError, match=r"runtime\.num_episode is a int, not a mapping"):
        load_config(main, ["runtime.num_episode.x=1"])


# ---------------------------------------------------------------- errors and dict loading


def test_invalid_yaml_names_file_and_line(tmp_path):
    main = write(tmp_path / "bad.yaml", "runtime:\n  num_episode: 3\n  colocation: [a, b\nmodels: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(main)
    message = str(info.value)
    assert str(main) in message
    assert "line 4" in message


def test_invalid_yaml_in_include_names_that_file(tmp_path):
    write(tmp_path / "inc.yaml", "a: 1\n b: 2\n")
    main = write(tmp_path / "main.yaml", "includes: [inc.yaml]\n")
    with pytest.raises(ConfigError) as info:
        load_config(main)
    assert str(tmp_path / "inc.yaml") in str(info.value)
    assert "line 2" in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nothing.yaml")


def test_load_config_dict(tmp_path, monkeypatch):
    monkeypatch.setenv("CL_EPISODES", "6")
    write(tmp_path / "inc.yaml", "runtime:\n  sample_per_episode: 32\n")
    write(tmp_path / "pm.yaml", "tensor_model_parallel_size: 2\n")
    data = {
        "includes": ["inc.yaml"],
        "runtime": {"num_episode": "${CL_EPISODES}"},
        "models": {"policy": {"num_gpu": 2, "model_config_file": "pm.yaml"}},
    }
    cfg = load_config_dict(data, str(tmp_path), ["runtime.exp_name=d"])
    assert (cfg.runtime.num_episode, cfg.runtime.sample_per_episode, cfg.runtime.exp_name) == (6, 32, "d")
    assert cfg.models["policy"].tensor_model_parallel_size == 2
    assert data["runtime"] == {"num_episode": "${CL_EPISODES}"}  # input untouched


# ---------------------------------------------------------------- ChatLearn's own configs
# (every published config against ChatLearn's own loader: tests/test_chatlearn_configs.py)


def test_chatlearn_tests_exp_yaml_include_precedence_and_env_override(reference_configs, monkeypatch):
    monkeypatch.delenv("num_training_epoch", raising=False)
    cfg = quiet_load(reference_configs / "tests/configs/exp.yaml")
    assert cfg.runtime.num_training_epoch == 3
    assert cfg.runtime.get("unknown_args") == "test_unknown"
    args = cfg.models["policy"].args_dict
    assert args["generate_config"]["eos_token_id"] == 103  # base2.yaml, the later include, wins
    assert args["model_config"]["attention_probs_dropout_prob"] == 0.1  # the including file wins
    assert args["test"] == 123
    monkeypatch.setenv("num_training_epoch", "2")  # ChatLearn's test_args2
    assert quiet_load(reference_configs / "tests/configs/exp.yaml").runtime.num_training_epoch == 2


def test_relative_prompt_paths_fall_back_to_the_config_folder(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "cfg"
    (cfg_dir / "data").mkdir(parents=True)
    (cfg_dir / "data" / "p.jsonl").write_text('{"prompt": "x"}\n')
    (cfg_dir / "main.yaml").write_text(
        "runtime:\n  data_path: data/p.jsonl\n  eval_data_path: data/p.jsonl\n"
        "models:\n  policy:\n    num_cpu: 1\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(cfg_dir / "main.yaml")
    assert cfg.runtime.data_path == str(cfg_dir / "data" / "p.jsonl")
    assert cfg.runtime.get("eval_data_path") == str(cfg_dir / "data" / "p.jsonl")
    # a file that exists relative to the working directory wins, as in ChatLearn
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "p.jsonl").write_text('{"prompt": "y"}\n')
    assert load_config(cfg_dir / "main.yaml").runtime.data_path == "data/p.jsonl"


def test_quoted_default_of_an_env_var_is_the_text(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_RECOMPUTE", raising=False)
    write(tmp_path / "m.yaml", "recompute_granularity: ${CL_RECOMPUTE:'selective'}\n")
    main = write(tmp_path / "main.yaml", "models:\n  policy:\n    num_gpu: 1\n    model_config_file: m.yaml\n")
    assert load_config(main).models["policy"].args_dict["recompute_granularity"] == "selective"


def test_unset_variable_for_a_field_that_cannot_be_none_names_both(tmp_path, monkeypatch):
    monkeypatch.delenv("CL_EPISODES", raising=False)
    monkeypatch.delenv("CL_DATA", raising=False)
    main = write(tmp_path / "main.yaml", "runtime:\n  num_episode: ${CL_EPISODES}\n  data_path: ${CL_DATA}\n"
                                         "models:\n  policy:\n    num_gpu: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(main)
    assert info.value.problems == ["runtime.num_episode: ${CL_EPISODES} is not set and has no default"]
    # an override fills it; data_path may be None (its default), with a warning naming the variable
    with pytest.warns(ConfigWarning, match=r"\$\{CL_DATA\} at runtime.data_path"):
        cfg = load_config(main, ["runtime.num_episode=3"])
    assert cfg.runtime.num_episode == 3 and cfg.runtime.data_path is None


def test_relative_paths_in_an_included_file_resolve_next_to_it(tmp_path, monkeypatch):
    base = tmp_path / "project" / "configs"
    write(base / "model.yaml", "hidden_size: 64\n")
    (base / "data").mkdir()
    (base / "data" / "train.jsonl").write_text('{"prompt": "x"}\n')
    write(base / "default.yaml", "runtime:\n  data_path: data/train.jsonl\n  eval_data_path: [data/train.jsonl]\n"
                                 "models:\n  policy:\n    num_cpu: 1\n    model_config_file: model.yaml\n")
    mine = write(tmp_path / "elsewhere" / "mine.yaml", "includes: [../project/configs/default.yaml]\n"
                                                       "runtime:\n  num_episode: 3\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(mine)
    assert cfg.models["policy"].args_dict == {"hidden_size": 64}
    assert cfg.models["policy"].model_config_file == str(base / "model.yaml")
    assert cfg.runtime.data_path == str(base / "data" / "train.jsonl")
    assert cfg.runtime.eval_data_path == [str(base / "data" / "train.jsonl")]
    # the main config's folder is the fallback (ChatLearn's rule): a model file only there is found there
    write(tmp_path / "elsewhere" / "only_here.yaml", "hidden_size: 32\n")
    cfg = load_config(mine, ["models.policy.model_config_file=only_here.yaml"])
    assert cfg.models["policy"].args_dict == {"hidden_size": 32}
