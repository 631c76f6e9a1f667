"""Property-based tests of the config loader: whatever a user writes (any YAML document, any nested dict with
any keys and values, any ``dotted.key=value`` override, any ``${...}`` text), loading gives a config or a
:class:`ConfigError` whose every problem names a place; never another exception (a KeyError, a TypeError, a
YAML parser's error) that would reach the user as a traceback."""

import copy
import json
import os
import string
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chatlearn.config import (
    BatchGenerationConfig,
    ChatLearnConfig,
    ConfigError,
    EngineChecks,
    LoraConfig,
    ModelConfig,
    RuntimeConfig,
    RuntimeEnvConfig,
    load_config,
    load_config_dict,
)
from chatlearn.config.deployment import DeploymentConfig
from chatlearn.config.envvars import parse_value, substitute_text
from tests.conftest import REPO

DEFAULT = os.path.join(REPO, "configs", "default.yaml")
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SET_VAR, UNSET_VAR = "CL_FUZZ_SET", "CL_FUZZ_UNSET"
SECTIONS = ["runtime_env", "runtime", "models", "deployment", "rlhf", "includes"]
FIELDS = sorted({*RuntimeEnvConfig.model_fields, *RuntimeConfig.model_fields, *ModelConfig.model_fields,
                 *LoraConfig.model_fields, *BatchGenerationConfig.model_fields, *DeploymentConfig.model_fields})
# misspellings and names of the built-in modules' arguments, so suggestions and args_dict are exercised
NEAR = ["num_episodes", "temprature", "temperature", "lora_dm", "ranking", "py_module", "policy", "reward",
        "max_new_tokens", "lr", "kl_coef", "num_inference_per_prompt", "args_dict", "lora", "batch_generation"]


@pytest.fixture(scope="module", autouse=True)
def _environment():
    """One variable set, one unset, for the ``${...}`` strategies (module-wide: hypothesis reruns a test body
    many times within one function-scoped fixture)."""
    saved = {n: os.environ.get(n) for n in (SET_VAR, UNSET_VAR)}
    os.environ[SET_VAR] = "3"
    os.environ.pop(UNSET_VAR, None)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def env_text() -> st.SearchStrategy[str]:
    """``${VAR}`` / ``${VAR:default}`` whole, inside text, nested or malformed."""
    name = st.sampled_from([SET_VAR, UNSET_VAR, "HOME", "9bad", ""])
    default = st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["1", "1e-5", "[1, 2]", "'q'", "a:b", "${"]))
    ref = st.builds(lambda n, d: "${" + n + ("" if d is None else ":" + d) + "}", name, default)
    return st.one_of(ref, st.builds(lambda a, r, b: a + r + b, st.text(max_size=4), ref, st.text(max_size=4)),
                     st.sampled_from(["${", "${}", "$}", "${A:${B}}", "${" + SET_VAR]))


KEYS = st.one_of(st.sampled_from(FIELDS + NEAR + SECTIONS), st.text(max_size=10), st.integers(-3, 3), st.booleans(),
                 st.none())
# what YAML or an environment can also give: bytes (!!binary), a lone surrogate ("\ud800" escape), a name too
# long for a file (a time zone is looked up as one)
ODD = st.one_of(st.binary(max_size=4), st.sampled_from(["\ud800", "a\udcff", "Europe/" + "x" * 300, "1e400", "UTC"]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                    env_text(), st.sampled_from(FIELDS + NEAR), ODD)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(KEYS, inner, max_size=4)), max_leaves=12)


def section_value() -> st.SearchStrategy[Any]:
    return st.one_of(VALUES, st.dictionaries(st.sampled_from(FIELDS + NEAR), VALUES, max_size=6))


MODEL = st.dictionaries(st.sampled_from(FIELDS + NEAR), st.one_of(VALUES, st.dictionaries(KEYS, VALUES, max_size=3)),
                        max_size=6)
CONFIG = st.dictionaries(
    st.one_of(st.sampled_from(SECTIONS), KEYS),
    st.one_of(section_value(), st.dictionaries(st.sampled_from(["policy", "reward", "x"]), st.one_of(MODEL, VALUES),
                                               max_size=3)),
    max_size=5,
)
OVERRIDE_KEY = st.lists(st.one_of(st.sampled_from(FIELDS + NEAR + SECTIONS), st.text(string.ascii_letters + "._ ",
                                                                                     max_size=6)),
                        min_size=0, max_size=4).map(".".join)
OVERRIDES = st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", OVERRIDE_KEY, st.one_of(env_text(), st.text(
    max_size=10), st.sampled_from(["1", "null", "[1,", "{a: 1}", "True", "-1"]))), st.text(max_size=10)), max_size=4)


def loads_or_names_the_problem(load: Callable[[], ChatLearnConfig]) -> None:
    """The property: a config (that prints as JSON, as `chatlearn config` does), or a ConfigError whose every
    problem is ``"place: message"``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = load()
        except ConfigError as exc:
            assert exc.problems
            for problem in exc.problems:
                place, sep, message = problem.partition(": ")
                assert sep and place.strip() and message.strip(), problem
                assert "\n" not in problem, problem
                problem.encode("utf-8")  # printable on a UTF-8 terminal
            return
    assert isinstance(cfg, ChatLearnConfig)
    json.dumps(cfg.model_dump(mode="json"))


@FAST
@given(data=CONFIG)
@example(data={" ": b"\x80"})  # found in CI: a blank key's problem named no place
@example(data={"runtime_env": [], "": b"\x80"})
def test_any_config_dict_gives_a_config_or_a_config_error(data):
    loads_or_names_the_problem(lambda: load_config_dict(data))


# what yaml.safe_dump never writes: aliases (one inside its own anchor), tags with bad values, escapes
YAML_ODDITIES = [
    "runtime: &a\n  x: *a\n", "a: &x [*x]\n", "runtime:\n  x: !!binary //79\n", "runtime:\n  exp_name: \"\\ud800\"\n",
    "runtime:\n  num_episode: !!int abc\n", "runtime:\n  exp_name: 2024-13-45\n", "runtime:\n  <<: 5\n",
    "runtime:\n  2024-01-01: 3\n", "models:\n  p: &m {num_gpu: 1}\n  q: *m\n",
    "deployment: {timezone: " + "x" * 300 + "}\n",
    "a: &a [x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
    "f: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
]


@FAST
@given(data=st.one_of(CONFIG, VALUES), mutation=st.tuples(st.integers(0, 400), st.text(max_size=6)),
       raw=st.one_of(st.none(), st.text(max_size=60), st.binary(max_size=40), st.sampled_from(YAML_ODDITIES)))
def test_any_yaml_file_gives_a_config_or_a_config_error(data, mutation, raw, tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    if raw is None:
        text = yaml.safe_dump(data, allow_unicode=True)
        at, insert = mutation
        path.write_text(text[:at] + insert + text[at:], encoding="utf-8")
    elif isinstance(raw, bytes):
        path.write_bytes(raw)
    else:
        path.write_text(raw, encoding="utf-8", errors="surrogatepass")
    loads_or_names_the_problem(lambda: load_config(path))


@pytest.fixture(scope="module")
def default_dict() -> dict[str, Any]:
    """The embedded default, resolved, as a dict (its model files already merged into args_dict): the fuzzed
    runs validate it again without parsing its YAML each time."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = load_config(DEFAULT).model_dump(mode="json")
    for model in data["models"].values():
        model["model_config_file"] = ""
    return data


@FAST
@given(overrides=OVERRIDES)
def test_any_overrides_give_a_config_or_a_config_error(overrides, default_dict):
    loads_or_names_the_problem(lambda: load_config_dict(default_dict, None, overrides))


ARG_KEYS = st.sampled_from(["temperature", "temprature", "max_new_tokens", "top_p", "top_k", "num_inference_per_prompt",
                            "lr", "kl_coef", "cliprange", "gamma", "dtype", "tiny_model", "model_path", "x", "1"])


@settings(max_examples=100, deadline=None)
@given(args=st.dictionaries(ARG_KEYS, VALUES, max_size=4), model=st.sampled_from(["policy", "reward", "ppo_policy"]))
def test_any_args_dict_gives_a_config_or_a_config_error_with_the_engine_checks(args, model, default_dict):
    # `module` and hook names are left out: the checks import what they name
    data = copy.deepcopy(default_dict)
    data["models"][model]["args_dict"].update(args)
    loads_or_names_the_problem(lambda: load_config_dict(data, None, (), [EngineChecks()]))


@FAST
@given(text=st.one_of(env_text(), st.text(max_size=20)), path=st.text(max_size=8))
def test_env_references_and_values_never_raise(text, path):
    missing: list = []
    substitute_text(text, path, missing)
    parse_value(text)
    assert all(m.path == path for m in missing)


def test_the_fuzz_environment_is_what_the_strategies_assume():
    assert os.environ.get(SET_VAR) == "3" and UNSET_VAR not in os.environ
    assert Path(DEFAULT).is_file()
