"""`runtime_env` reaches Ray as ChatLearn builds it (the shipping itself is tested by a real run in
tests/test_placement_runs.py, whose reward function only `py_modules` brings to the workers)."""

import importlib
import os

from chatlearn.config import load_config
from chatlearn.config.user_code import user_code
from chatlearn.runtime.cluster.launch import ALWAYS_EXCLUDED, SETUP_HOOK, ray_runtime_env
from chatlearn.utils.imports import CODE_PATH_VAR, code_dirs_on_path


def _env(monkeypatch, tmp_path, **runtime_env):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return ray_runtime_env(load_config({"runtime_env": runtime_env, "models": {"policy": {"num_cpu": 1}}}, checks=[]))


# every worker finds the user's code folders (here only the current directory: the config is built in code)
def _code(tmp_path):
    return {"env_vars": {CODE_PATH_VAR: str(tmp_path)}, "worker_process_setup_hook": SETUP_HOOK}


def test_nothing_to_ship_is_only_the_code_folders(monkeypatch, tmp_path):
    assert _env(monkeypatch, tmp_path) == _code(tmp_path)
    # a local run already works in the current directory: not uploaded as a working_dir
    assert _env(monkeypatch, tmp_path, working_dir=str(tmp_path)) == _code(tmp_path)
    hook = SETUP_HOOK.rsplit(".", 1)
    assert getattr(importlib.import_module(hook[0]), hook[1]) is code_dirs_on_path


def test_fields_reach_ray(monkeypatch, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    env = _env(monkeypatch, tmp_path, pip=["six==1.16.0"], py_modules=[str(code / "pkg")], working_dir=str(code),
               excludes=["*.ckpt"])
    assert env == {**_code(tmp_path), "pip": ["six==1.16.0"], "py_modules": [str(code / "pkg")],
                   "working_dir": str(code), "excludes": ["*.ckpt", *ALWAYS_EXCLUDED]}
    monkeypatch.setenv("PYTHONPATH", "/opt/extra")
    env = ray_runtime_env(load_config({"models": {"policy": {"num_cpu": 1}}}, checks=[]))
    assert env["env_vars"] == {CODE_PATH_VAR: str(tmp_path), "PYTHONPATH": "/opt/extra"}
    assert os.getcwd() == str(tmp_path)


def test_a_cluster_run_ships_the_hooks_found_in_the_code_folders(monkeypatch, tmp_path):
    """Joining a cluster (RAY_ADDRESS), the other nodes may not share this file system: the hooks' own files
    (not the installed ones) go as py_modules; the code folders (config folder, file-form hooks) as before."""
    conf, hooks = tmp_path / "conf", tmp_path / "hooks"
    (conf / "pkgreward").mkdir(parents=True)
    hooks.mkdir()
    (conf / "myreward.py").write_text("def fn(sample):\n    return 1.0\n")
    (conf / "pkgreward" / "__init__.py").write_text("def fn(sample):\n    return 1.0\n")
    (hooks / "relay.py").write_text("def keep(buffers):\n    return []\n")
    (conf / "run.yaml").write_text(
        "runtime:\n  relay_sample_fn: hooks/relay.py:keep\n  eval_post_process_fn: pkgreward:fn\n"
        "models:\n  reward:\n    num_cpu: 1\n    args_dict:\n      reward_fn: myreward:fn\n"
        "  policy:\n    num_cpu: 1\n    args_dict:\n      module: chatlearn.models.hf.policy:PolicyInference\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    cfg = load_config(str(conf / "run.yaml"), checks=[])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with user_code(cfg):
        local = ray_runtime_env(cfg)
    assert local["env_vars"][CODE_PATH_VAR].split(os.pathsep) == [str(tmp_path), str(conf), str(hooks)]
    assert "py_modules" not in local  # one machine: the workers read the same folders
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    with user_code(cfg):
        cluster = ray_runtime_env(cfg)
    assert sorted(cluster["py_modules"]) == sorted([str(hooks / "relay.py"), str(conf / "pkgreward"),
                                                   str(conf / "myreward.py")])
