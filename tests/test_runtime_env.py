"""`runtime_env` reaches Ray as ChatLearn builds it (the shipping itself is tested by a real run in
tests/test_placement_runs.py, whose reward function only `py_modules` brings to the workers)."""

import os

from chatlearn.config import load_config
from chatlearn.runtime.launch import ALWAYS_EXCLUDED, ray_runtime_env


def _env(monkeypatch, tmp_path, **runtime_env):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    return ray_runtime_env(load_config({"runtime_env": runtime_env, "models": {"policy": {"num_cpu": 1}}}, checks=[]))


def test_nothing_to_ship_is_no_runtime_env(monkeypatch, tmp_path):
    assert _env(monkeypatch, tmp_path) is None
    assert _env(monkeypatch, tmp_path, working_dir=str(tmp_path)) is None  # a local run already works there


def test_fields_reach_ray(monkeypatch, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    env = _env(monkeypatch, tmp_path, pip=["six==1.16.0"], py_modules=[str(code / "pkg")], working_dir=str(code),
               excludes=["*.ckpt"])
    assert env == {"pip": ["six==1.16.0"], "py_modules": [str(code / "pkg")], "working_dir": str(code),
                   "excludes": ["*.ckpt", *ALWAYS_EXCLUDED]}
    monkeypatch.setenv("PYTHONPATH", "/opt/extra")
    env = ray_runtime_env(load_config({"models": {"policy": {"num_cpu": 1}}}, checks=[]))
    assert env == {"env_vars": {"PYTHONPATH": "/opt/extra"}}
    assert os.getcwd() == str(tmp_path)
