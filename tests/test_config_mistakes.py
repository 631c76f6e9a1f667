"""Mistakes in a config are named: a misspelt key gets the nearest known name, an unset ``${VAR}`` without a
default names the field and the variable, and none of them silently leaves a field at its default."""

import os
import textwrap
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from chatlearn.cli import main
from chatlearn.config import ConfigError, ConfigWarning, EngineChecks, load_config, load_config_dict
from chatlearn.models.base_module import BaseModule
from tests.conftest import REPO

DEFAULT = os.path.join(REPO, "configs", "default.yaml")
MINIMAL = "models:\n  policy:\n    num_gpu: 1\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def config_warnings(load, *args, **kwargs) -> tuple[object, list[str]]:
    """(the loaded config, the ConfigWarning messages it gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load(*args, **kwargs)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def problems(*args, **kwargs) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with pytest.raises(ConfigError) as info:
            load_config(*args, **kwargs)
    return info.value.problems


@pytest.fixture
def unset(monkeypatch):
    for name in ("CL_MISTAKE_EPISODES", "CL_MISTAKE_OUT", "CL_MISTAKE_SECTION", "CL_MISTAKE_LEN", "CL_MISTAKE_INC"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- misspelt keys


def test_misspelt_runtime_key_in_an_override_suggests_the_field():
    cfg, warned = config_warnings(load_config, DEFAULT, ["runtime.num_episodes=3"])
    assert warned == ["runtime.num_episodes: unknown key, kept as a user extra (read with "
                      "runtime.get('num_episodes')); did you mean num_episode?"]
    # ChatLearn keeps it as a user extra: readable, and the field keeps its value
    assert cfg.runtime.get("num_episodes") == 3 and cfg.runtime.num_episode == 20


def test_misspelt_runtime_key_in_yaml_suggests_the_field(tmp_path):
    main_yaml = write(tmp_path / "m.yaml", "runtime:\n  num_episodes: 3\n  query_key: q\n" + MINIMAL)
    _, warned = config_warnings(load_config, main_yaml)
    assert len(warned) == 1 and "did you mean num_episode?" in warned[0]  # query_key: a user extra, no guess


def test_runtime_env_extras_warn_only_when_they_look_like_a_field():
    data = {"runtime_env": {"py_module": ["x"], "env_vars": {"A": "1"}}, "models": {"p": {"num_gpu": 1}}}
    cfg, warned = config_warnings(load_config_dict, data)
    assert warned == ["runtime_env.py_module: unknown key, kept as a user extra (read with "
                      "runtime_env.get('py_module')); did you mean py_modules?"]
    assert cfg.runtime_env.get("env_vars") == {"A": "1"}


def test_unknown_model_key_names_the_nearest_field_or_args_dict():
    _, warned = config_warnings(load_config_dict, {"models": {"p": {"num_gpu": 1, "num_gpus": 2, "lr": 1}}})
    assert warned == [
        "models.p.num_gpus: unknown argument, kept but not used by ChatLearn; did you mean num_gpu?",
        "models.p.lr: unknown argument, kept but not used by ChatLearn; a backend hyper-parameter goes in args_dict",
    ]


def test_misspelt_lora_key_is_an_error_with_the_nearest_field():
    assert problems({"models": {"p": {"num_gpu": 1, "lora": {"lora_dm": 4}}}}) == [
        "models.p.lora.lora_dm: unknown key, not defined in LoraConfig; did you mean lora_dim?"]


def test_misspelt_top_level_key_suggests_the_section():
    _, warned = config_warnings(load_config_dict, {"runtimes": {}, "models": {"p": {"num_gpu": 1}}})
    assert warned == ["runtimes: unknown top-level key ignored (known: runtime_env, runtime, models, deployment); "
                      "did you mean runtime?"]


def test_misspelt_args_dict_key_of_a_built_in_module_is_an_error():
    found = problems(DEFAULT, ["models.policy.args_dict.temprature=0.5", "models.reward.args_dict.kl_coeff=0.1"],
                     [EngineChecks()])
    assert found == [
        "models.policy.args_dict.temprature: unknown argument of PolicyInference (not in PolicyArgs); "
        "did you mean temperature?",
        "models.reward.args_dict.kl_coeff: unknown argument of RuleReward (not in RuleRewardArgs); "
        "did you mean kl_coef?",
    ]
    # ChatLearn's loader keeps args_dict as given: only the engine's checks know the module's arguments
    assert load_config(DEFAULT, ["models.policy.args_dict.temprature=0.5"]).models["policy"].args_dict[
        "temprature"] == 0.5


def test_args_dict_of_a_built_in_module_allows_its_module_and_parallel_keys():
    args = ("models.reward.args_dict.module=chatlearn.models.hf.reward:RuleReward",
            "models.policy.args_dict.tensor_model_parallel_size=1")
    load_config(DEFAULT, args, [EngineChecks()])


class FreeArgs(BaseModel):
    model_config = ConfigDict(extra="allow")

    temperature: float = 1.0


class UserPolicy(BaseModule):
    """A user's module: its own args_schema decides what its args_dict holds."""

    args_schema = FreeArgs


def test_args_dict_of_a_user_module_stays_free():
    load_config(DEFAULT, ["models.policy.args_dict.temprature=0.5"], [EngineChecks(modules={"policy": UserPolicy(
        "policy")})])


# ---------------------------------------------------------------- ${VAR} with no value and no default


def test_unset_variable_in_a_field_names_field_and_variable(tmp_path, unset):
    main_yaml = write(tmp_path / "m.yaml", "runtime:\n  num_episode: ${CL_MISTAKE_EPISODES}\n" + MINIMAL)
    assert problems(main_yaml) == ["runtime.num_episode: ${CL_MISTAKE_EPISODES} is not set and has no default"]


def test_unset_variable_inside_text_is_an_error_not_an_empty_string(tmp_path, unset):
    # before: output_dir became "/out" (the reference replaced by '') with only a warning
    main_yaml = write(tmp_path / "m.yaml", "runtime:\n  output_dir: ${CL_MISTAKE_OUT}/out\n" + MINIMAL)
    assert problems(main_yaml) == [
        "runtime.output_dir: ${CL_MISTAKE_OUT} is not set and has no default (inside text)"]


def test_unset_variable_for_a_whole_section_is_an_error(tmp_path, unset):
    # before: runtime silently took every default (num_episode 5000)
    main_yaml = write(tmp_path / "m.yaml", "runtime: ${CL_MISTAKE_SECTION}\n" + MINIMAL)
    assert problems(main_yaml) == ["runtime: ${CL_MISTAKE_SECTION} is not set and has no default"]
    assert problems({"models": "${CL_MISTAKE_SECTION}"}) == [
        "models: ${CL_MISTAKE_SECTION} is not set and has no default"]


def test_unset_variable_in_the_deprecated_rlhf_section_is_named(tmp_path, unset):
    main_yaml = write(tmp_path / "m.yaml", "rlhf:\n  num_episode: ${CL_MISTAKE_EPISODES}\n" + MINIMAL)
    assert problems(main_yaml) == ["runtime.num_episode: ${CL_MISTAKE_EPISODES} is not set and has no default"]


def test_unset_variable_in_an_override_is_named(unset):
    assert problems(DEFAULT, ["runtime.num_episode=${CL_MISTAKE_EPISODES}"]) == [
        "runtime.num_episode: ${CL_MISTAKE_EPISODES} is not set and has no default"]
    assert load_config(DEFAULT, ["runtime.num_episode=${CL_MISTAKE_EPISODES:4}"]).runtime.num_episode == 4


def test_unset_variable_in_an_included_model_file_is_named_with_its_full_path(tmp_path, unset):
    write(tmp_path / "base.yaml", "seq_length: ${CL_MISTAKE_LEN}\n")
    write(tmp_path / "model.yaml", "includes: [base.yaml]\nhidden_size: 8\n")
    main_yaml = write(tmp_path / "m.yaml", MINIMAL + "    model_config_file: model.yaml\n")
    # a backend key may be None (as in ChatLearn), so a warning, naming where it is
    cfg, warned = config_warnings(load_config, main_yaml)
    assert cfg.models["policy"].args_dict == {"seq_length": None, "hidden_size": 8}
    assert warned == ["environment variables not set and without a default (values set to None): "
                      "${CL_MISTAKE_LEN} at models.policy.args_dict.seq_length"]


def test_unset_variable_in_an_include_name_is_named(tmp_path, unset):
    main_yaml = write(tmp_path / "m.yaml", "includes: ['${CL_MISTAKE_INC}.yaml']\n" + MINIMAL)
    assert problems(main_yaml) == [f"{main_yaml}: includes: ${{CL_MISTAKE_INC}} is not set and has no default"]


def test_unset_variable_as_the_includes_list_is_named(tmp_path, unset):
    # before: `includes: None`, so no file was included (only a warning)
    main_yaml = write(tmp_path / "m.yaml", "includes: ${CL_MISTAKE_INC}\n" + MINIMAL)
    assert problems(main_yaml) == [f"{main_yaml}: includes: ${{CL_MISTAKE_INC}} is not set and has no default"]


# ---------------------------------------------------------------- YAML values the parser refuses


@pytest.mark.parametrize("text", ["runtime:\n  num_episode: !!int abc\n", "runtime:\n  exp_name: 2024-13-45\n"])
def test_a_yaml_value_the_parser_refuses_is_a_config_error_naming_the_file(tmp_path, text):
    main_yaml = write(tmp_path / "m.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(main_yaml)
    (problem,) = info.value.problems
    assert problem.startswith(f"{main_yaml}: invalid YAML value: ")


# six levels of ten aliases each: a few lines of YAML that a loader copying every alias would expand 10^6 times
NESTED_ALIASES = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]\n" for prev, name in zip("abcde", "bcdef", strict=True))


@pytest.mark.parametrize("text,expected", [
    ("runtime: &a\n  x: *a\n", "{path}: invalid YAML: an alias (*name) is used inside the value its anchor (&name) "
                                 "marks, so the value would contain itself"),
    (NESTED_ALIASES, "{path}: invalid YAML: its aliases expand to 1234567 values (at most 1000000)"),
    ("runtime:\n  x: !!binary //79\n", "runtime.x: binary data (!!binary) that is not UTF-8 text"),
    ('runtime:\n  exp_name: "\\ud800"\n', "runtime.exp_name: '\\ud800' is not valid text (a lone surrogate: a "
                                           "\\ud800-style escape or a non-UTF-8 environment variable)"),
    ("deployment:\n  timezone: " + "x" * 300 + "\n", "deployment.timezone: unknown time zone"),
])
def test_what_the_fuzzer_found_is_a_config_error(tmp_path, text, expected):
    """Each of these leaked a RecursionError, a UnicodeError on printing the config, or an OSError."""
    main_yaml = write(tmp_path / "m.yaml", text)
    found = problems(main_yaml)
    assert found[0].startswith(expected.format(path=main_yaml)), found
    for problem in found:
        problem.encode("utf-8")


def test_a_problem_is_one_line():
    assert ConfigError(["a.b: first\n  second line\n"]).problems == ["a.b: first second line"]


# ---------------------------------------------------------------- the command line


def test_chatlearn_config_prints_each_problem_on_one_line_and_exits_2(tmp_path, unset, capsys):
    main_yaml = write(tmp_path / "m.yaml", "runtime:\n  num_episode: ${CL_MISTAKE_EPISODES}\n"
                                           "  output_dir: ${CL_MISTAKE_OUT}/out\n" + MINIMAL)
    assert main(["config", str(main_yaml)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        "chatlearn: invalid config (2 problem(s)):",
        "  - runtime.num_episode: ${CL_MISTAKE_EPISODES} is not set and has no default",
        "  - runtime.output_dir: ${CL_MISTAKE_OUT} is not set and has no default (inside text)",
    ]


def test_chatlearn_config_check_names_a_misspelt_module_argument(capsys):
    assert main(["config", "--check", "models.policy.args_dict.temprature=0.5"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "chatlearn: invalid config (1 problem(s)):",
        "  - models.policy.args_dict.temprature: unknown argument of PolicyInference (not in PolicyArgs); "
        "did you mean temperature?",
    ]


def test_chatlearn_config_warns_about_a_misspelt_runtime_key_on_one_line(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["config", "runtime.num_episodes=3"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert ("chatlearn: warning: runtime.num_episodes: unknown key, kept as a user extra (read with "
            "runtime.get('num_episodes')); did you mean num_episode?") in err
