"""A deployment's code is pinned (flows/pins.py), without a server: the parameter schema refuses each changed code
field naming it (validated as Prefect's server validates), the flow's own check refuses it through every route
(the form, `overrides`, `config_path`, a model's config file, the `engine` and `modules` parameters) before
anything is imported, every config field that names code is a pinned one, and the work pool chatlearn creates
lets no run choose the worker's command. The same against a real server and worker:
tests/test_deployments.py::test_deploy_form_overlap_trigger_artifacts_and_browser."""

import ast
import copy
import importlib
import inspect
import json
import os
import pkgutil
import uuid
from fnmatch import fnmatch

import pytest
from pydantic import BaseModel

from chatlearn.config import ConfigError, load_config
from chatlearn.config.user_code import CODE_FIELDS, code_fields, hook_specs
from tests.conftest import REPO

DEFAULT = os.path.join(REPO, "configs", "default.yaml")


@pytest.fixture
def deployed(tmp_path, monkeypatch):
    """The embedded default deployed as `chatlearn-train/t` (its record in a fresh Prefect home), and this process
    inside one of its runs: (record path, the run form)."""
    from flows import pins
    from flows.deployments import form_defaults

    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(tmp_path / "home"))
    dep_id = uuid.uuid4()
    cfg = load_config(DEFAULT)
    path = pins.record(dep_id, "chatlearn-train/t", cfg)
    monkeypatch.setattr(pins, "_deployment_id", lambda: dep_id)
    return path, form_defaults(cfg)


def problems(**params) -> list[str]:
    from flows.pins import check_run

    with pytest.raises(ConfigError) as refused:
        check_run(**params)
    return refused.value.problems


def test_the_code_fields_of_a_config_and_what_it_imports(tmp_path):
    cfg = load_config(os.path.join(REPO, "configs", "grpo_math.yaml"))
    fields = code_fields(cfg)
    assert fields["runtime.engine"] == "grpo_math"
    assert fields["models.reward1.args_dict.reward_fn"] == "chatlearn.tasks.max_digit:format_reward"
    assert fields["models.policy.args_dict.module"] is None
    assert fields["runtime_env.pip"] == [] and fields["runtime_env.working_dir"] == os.getcwd()
    assert all(any(fnmatch(path, p) for p in CODE_FIELDS) for path in fields)
    assert hook_specs(cfg) == ["chatlearn.tasks.max_digit:eval_metrics", "chatlearn.tasks.max_digit:max_digit_reward",
                               "chatlearn.tasks.max_digit:format_reward"]


@pytest.mark.slow
def test_the_parameter_schema_refuses_each_changed_code_field_naming_it():
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import ValidationError, validate

    from flows.deployments import form_defaults
    from flows.pins import pin_schema
    from flows.train_flow import train_flow

    cfg = load_config(DEFAULT)
    schema = pin_schema(parameter_schema(train_flow).model_dump_for_openapi(), cfg)
    form = form_defaults(cfg)

    def refusal(change=None, **params):
        config = copy.deepcopy(form)
        if change:
            change(config)
        try:
            validate({"config": config, **params}, schema, raise_on_error=True)  # what the server runs
        except ValidationError as exc:
            return str(exc)
        return None

    def setter(*path, value):
        def change(config):
            node = config
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        return change

    assert refusal() is None
    assert refusal(setter("runtime", "num_episode", value=3)) is None  # the rest of the form is the form's
    assert refusal(setter("models", "policy", "num_cpu", value=2)) is None
    assert refusal(overrides=["runtime.num_episode=3", "models.policy.args_dict.lr=0.1"]) is None
    assert refusal(setter("models", "extra", value={"num_cpu": 1, "args_dict": {"lr": 1}})) is None
    refused = {
        "config.runtime.relay_sample_fn": refusal(setter("runtime", "relay_sample_fn", value="os:system")),
        "config.runtime.eval_post_process_fn": refusal(setter("runtime", "eval_post_process_fn", value="os:getcwd")),
        "config.runtime.engine": refusal(setter("runtime", "engine", value="grpo")),
        "config.models.policy.args_dict.module": refusal(setter("models", "policy", "args_dict", "module",
                                                                 value="os:system")),
        "config.models.reward.args_dict.reward_fn": refusal(setter("models", "reward", "args_dict", "reward_fn",
                                                                    value="os:system")),
        "config.models.extra.args_dict.module": refusal(setter("models", "extra", value={"args_dict": {
            "module": "os:system"}})),
        "config.runtime_env.pip": refusal(setter("runtime_env", "pip", value=["anything"])),
        "config.runtime_env.working_dir": refusal(setter("runtime_env", "working_dir", value="/tmp")),
        "config.runtime_env'": refusal(setter("runtime_env", "env_vars", value={"A": "1"})),
        "config.models.reward.args_dict'": refusal(lambda c: c["models"]["reward"]["args_dict"].pop("reward_fn")),
        "'engine'": refusal(engine="grpo"),
        "'modules'": refusal(modules={"policy": "os:system"}),
    }
    for field, message in refused.items():
        assert message is not None and f"Validation failed for field {field.strip(chr(39))!r}" in message.replace(
            '"', "'"), (field, message)
    for override in ("runtime.relay_sample_fn=os:system", " runtime . engine = grpo", "runtime={}", "models={}",
                     "models.reward.args_dict={}", "models.x.args_dict.module=os:system", "runtime_env.pip=[a]",
                     "runtime_env.env_vars.A=1"):
        assert "Validation failed for field 'overrides[0]'" in refusal(overrides=[override]), override


def test_a_run_that_changes_a_pinned_field_is_refused_naming_it_before_anything_is_imported(deployed, tmp_path,
                                                                                              monkeypatch):
    from flows.pins import check_run

    record, form = deployed
    assert json.loads(record.read_text())["deployment"] == "chatlearn-train/t"
    marker = tmp_path / "imported"
    (tmp_path / "evil_pin.py").write_text(f"open({str(marker)!r}, 'w').close()\n\ndef fn(*a):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # importable, were anything to import it
    check_run(config=form)  # the form as deployed
    check_run(config=form, overrides=["runtime.num_episode=2"])
    check_run(config_path=DEFAULT)  # the same config from its file

    changed = copy.deepcopy(form)
    changed["runtime"]["relay_sample_fn"] = "evil_pin:fn"
    (problem,) = problems(config=changed)
    assert problem.startswith("runtime.relay_sample_fn: 'evil_pin:fn' differs from None, pinned when "
                              "chatlearn-train/t was deployed")
    assert [p.split(":")[0] for p in problems(config=form, overrides=["models.reward.args_dict.reward_fn=evil_pin:fn",
                                                                      "runtime_env.pip=[evil]"])] == [
        "models.reward.args_dict.reward_fn", "runtime_env.pip"]
    # a model's config file brings a module class in
    (tmp_path / "model.yaml").write_text("module: evil_pin:fn\n")
    assert [p.split(":")[0] for p in problems(config=form, overrides=[
        f"models.policy.model_config_file={tmp_path / 'model.yaml'}"])] == ["models.policy.args_dict.module"]
    # another YAML, the engine parameter, model objects
    assert [p.split(":")[0] for p in problems(config_path=os.path.join(REPO, "configs", "grpo.yaml"))][:1] == [
        "runtime.engine"]
    assert [p.split(":")[0] for p in problems(config=form, engine="grpo")] == ["runtime.engine"]
    assert problems(config=form, modules={"policy": object()})[0].startswith("modules: ")
    assert not marker.exists()  # nothing named by a refused run was imported


def test_a_deployment_without_a_record_is_held_to_its_own_default_parameters(tmp_path, monkeypatch):
    """`prefect deploy` of deployments/prefect.yaml writes no record: the parameters the server keeps pin it."""
    from types import SimpleNamespace

    from flows import pins

    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(tmp_path))
    monkeypatch.setattr(pins, "_deployment_id", lambda: uuid.uuid4())

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read_deployment(self, _):
            return SimpleNamespace(name="default", flow_id=1,
                                   parameters={"config_path": DEFAULT, "overrides": []})

        def read_flow(self, _):
            return SimpleNamespace(name="chatlearn-train")

    monkeypatch.setattr(pins, "get_client", lambda sync_client: Client())
    pins.check_run(config_path=DEFAULT, overrides=["runtime.num_episode=1"])
    (problem,) = problems(config_path=DEFAULT, overrides=["runtime.relay_sample_fn=os:getcwd"])
    assert problem.startswith("runtime.relay_sample_fn: 'os:getcwd' differs from None, pinned when "
                              "chatlearn-train/default was deployed")


def test_outside_a_deployment_run_nothing_is_checked():
    from flows.pins import check_run

    check_run(config_path=DEFAULT, overrides=["runtime.relay_sample_fn=os:system"], modules={"x": object()})


def _config_models():
    """Every pydantic model of a config section or a built-in module's args_dict, with its dotted path."""
    import chatlearn.models as models_pkg
    from chatlearn.config.deployment import DeploymentConfig
    from chatlearn.config.model import BatchGenerationConfig, LoraConfig, ModelConfig
    from chatlearn.config.runtime import RuntimeConfig, RuntimeEnvConfig

    found = [("runtime_env", RuntimeEnvConfig), ("runtime", RuntimeConfig), ("models.*", ModelConfig),
             ("models.*.lora", LoraConfig), ("models.*.batch_generation", BatchGenerationConfig),
             ("deployment", DeploymentConfig)]
    for info in pkgutil.walk_packages(models_pkg.__path__, "chatlearn.models."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseModel) and cls.__module__ == info.name:
                found.append(("models.*.args_dict", cls))
    return found


def test_every_config_field_that_names_code_is_pinned():
    """A field that names code to import (its description shows 'package.module:...' or a file form, or its name
    says hook, function, class or module) must be one of CODE_FIELDS, which a deployment pins: a new such field
    that is not fails here."""
    naming_code = set()
    for prefix, model in _config_models():
        for name, info in model.model_fields.items():
            text = info.description or ""
            if ("module:" in text or ".py:" in text or name.endswith(("_fn", "_hook", "_class", "_cls"))
                    or name == "module"):
                naming_code.add(f"{prefix}.{name}")
    assert {"runtime.relay_sample_fn", "runtime.eval_post_process_fn", "models.*.args_dict.module",
            "models.*.args_dict.reward_fn"} <= naming_code  # the scan sees the fields we know
    assert [f for f in sorted(naming_code) if not any(fnmatch(f, p) for p in CODE_FIELDS)] == []


# Every place that imports code a config names, and the pinned field it imports from. A new place (a new call of
# these) fails the test below: pin the field it imports (CODE_FIELDS) and add it here.
IMPORTERS = {
    ("chatlearn/config/engine_checks.py", "import_object"),  # runtime.engine, models.*.args_dict.module
    ("chatlearn/config/engines.py", "import_object"),  # runtime.engine
    ("chatlearn/runtime/plan.py", "import_object"),  # models.*.args_dict.module (the checks' stand-ins)
    ("chatlearn/config/engine_checks.py", "import_class"),  # runtime.agent.env
    ("chatlearn/envs/base.py", "import_class"),  # runtime.agent.env
    ("chatlearn/envs/gym.py", "import_object"),  # runtime.agent.env_args.factory
    ("chatlearn/config/engine_checks.py", "import_callable"),  # runtime.relay_sample_fn, eval_post_process_fn
    ("chatlearn/runtime/engines.py", "import_object"),  # runtime.engine, models.*.args_dict.module
    ("chatlearn/models/rule.py", "import_callable"),  # models.*.args_dict.reward_fn
    ("chatlearn/models/hf/reward.py", "import_callable"),  # models.*.args_dict.reward_fn
    ("chatlearn/models/hf/tiny.py", "import_callable"),  # WARM_STARTS[tiny_model.warm_start]: a name, our code
    ("chatlearn/data/relay.py", "import_callable"),  # load_hook: the two below
    ("chatlearn/runtime/records/evaluation.py", "load_hook"),  # runtime.eval_post_process_fn
    ("chatlearn/runtime/cluster/stream_dataset.py", "load_hook"),  # runtime.relay_sample_fn
    ("chatlearn/utils/imports.py", "import_module"),  # the importer itself
    ("chatlearn/utils/imports.py", "import_object"),
    ("chatlearn/__init__.py", "import_module"),  # the package's own lazy names, no config
}
IMPORTING_CALLS = {"import_object", "import_callable", "import_class", "load_hook", "import_module", "__import__",
                   "spec_from_file_location", "run_path", "exec_module", "load_entry_point"}


def test_code_named_in_a_config_is_imported_only_where_it_is_known_to_be_pinned():
    calls = set()
    for top in ("chatlearn", "flows"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                    if isinstance(node, ast.Call):
                        func = node.func
                        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                        if called in IMPORTING_CALLS:
                            calls.add((os.path.relpath(path, REPO), called))
    assert sorted(calls - IMPORTERS) == [], "a new place imports code: pin the config field it reads (CODE_FIELDS)"
    assert sorted(IMPORTERS - calls) == []


def test_the_work_pool_chatlearn_creates_lets_no_run_choose_what_the_worker_executes():
    from flows.deployments import RUN_CHOSEN_JOB_VARIABLES, locked_job_template

    template = locked_job_template()
    with open(os.path.join(REPO, "deployments", "work-pool.json")) as f:
        assert json.load(f) == template  # what the README's `prefect work-pool create --base-job-template` uses
    for key in RUN_CHOSEN_JOB_VARIABLES:
        assert key not in template["variables"]["properties"] and key not in template["job_configuration"]
    assert template["variables"]["additionalProperties"] is False
