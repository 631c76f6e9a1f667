"""The project installed like a package: the wheel carries the packaged configs (the repository's top-level
`configs/`, shipped as `chatlearn/configs`), a config is named without a folder (`chatlearn train grpo`), and
an installed `chatlearn train` runs one episode from a directory that is not the repository.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

from chatlearn.config import ConfigError, configs_dir, default_config_path, load_config, packaged_configs
from tests.conftest import FAULT_VARIABLES, REPO

RUN_CONFIGS = ["agent_calculator", "agent_higher_lower", "dapo", "default", "dpo", "grpo", "grpo_async", "grpo_vllm",
               "grpo_gsm8k_qwen", "grpo_math", "online_dpo", "reinforce_pp", "rloo"]
# one episode, small: the run proves the installed package works, not the training
SMALL = ["runtime.num_episode=1", "runtime.sample_per_episode=16", "runtime.generation_batch_size=16",
         "runtime.train_micro_batch_size=16", "runtime.train_global_batch_size=16", "runtime.eval_episode_interval=0",
         "runtime.enable_eval_before_training=false"]


def test_pyproject_lists_every_package_and_maps_configs():
    # the package list is explicit (find cannot add a mapped folder): a new subpackage missing from it would be
    # missing from the wheel, while the editable install (the repository's folders) still imported it
    setup = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {"chatlearn.configs": "configs"}
    root = Path(REPO) / "configs"
    config_dirs = {".".join(["chatlearn", "configs", *p.relative_to(root).parts])
                   for p in [root, *root.rglob("*")] if p.is_dir() and p.name != "__pycache__"}
    assert config_dirs == {"chatlearn.configs", "chatlearn.configs.data"}
    code = set(find_packages(where=REPO, include=["chatlearn*", "flows*"]))
    assert sorted(setup["packages"]) == sorted(code | config_dirs)


def test_the_source_tree_finds_the_repository_configs():
    assert configs_dir() == Path(REPO) / "configs"
    assert default_config_path() == Path(REPO) / "configs" / "default.yaml"
    assert packaged_configs() == {name: Path(REPO) / "configs" / f"{name}.yaml" for name in RUN_CONFIGS}


def test_a_packaged_config_is_named_without_a_folder_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CHATLEARN_OUTPUT_DIR", raising=False)
    monkeypatch.delenv("CHATLEARN_TINY_MODEL_DIR", raising=False)
    for name in ("grpo", "grpo.yaml"):
        cfg = load_config(name)
        assert cfg.runtime.engine == "grpo"
        # data next to the packaged config; outputs and the tiny model relative to the current directory
        assert cfg.runtime.data_path == str(Path(REPO) / "configs" / "data" / "max_digit_train.jsonl")
        assert cfg.runtime.output_dir == "./output/grpo"
        assert cfg.models["policy"].args_dict["model_path"] == "./output/tiny-llama"
    assert load_config("default").runtime.exp_name == "default"


def test_a_file_in_the_current_directory_wins_over_the_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "grpo.yaml").write_text("includes: [" + str(default_config_path()) + "]\n"
                                        "runtime:\n  exp_name: mine\n")
    assert load_config("grpo.yaml").runtime.exp_name == "mine"
    assert load_config("grpo").runtime.engine == "grpo"  # no file named `grpo`: the packaged one


def test_a_missing_config_lists_the_packaged_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = ("(packaged configs, named without a folder: agent_calculator, agent_higher_lower, dapo, default, dpo, "
             "grpo, grpo_async, grpo_gsm8k_qwen, grpo_math, grpo_vllm, online_dpo, reinforce_pp, rloo)")
    with pytest.raises(ConfigError) as info:
        load_config("configs/grpo.yaml")  # the README's path, from a directory without configs/
    assert info.value.problems == [f"configs/grpo.yaml: config file not found; did you mean the packaged 'grpo'? "
                                   f"{names}"]
    with pytest.raises(ConfigError) as info:
        load_config("tiny_llama")  # a model config file, not a run config
    assert info.value.problems == [f"tiny_llama: config file not found {names}"]


def test_a_config_of_ones_own_includes_the_packaged_default_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("includes: [default.yaml]\nruntime:\n  exp_name: mine\n")
    cfg = load_config("mine.yaml")
    assert cfg.runtime.exp_name == "mine"
    # the default's own relative files come from the package: its data and the tiny model's spec
    assert cfg.runtime.data_path == str(Path(REPO) / "configs" / "data" / "max_digit_train.jsonl")
    assert cfg.models["policy"].args_dict["tiny_model"]["hidden_size"] == 256
    (tmp_path / "typo.yaml").write_text("includes: [defualt.yaml]\n")
    with pytest.raises(ConfigError, match="file 'defualt.yaml' not found"):
        load_config("typo.yaml")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.integration
def test_the_wheel_installed_in_a_fresh_venv_trains_from_another_directory(prefect_api, tmp_path):
    t0 = time.monotonic()
    # build from a copy: pip builds in-tree, and build/ or egg-info in the checkout would race other runs
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("chatlearn", "flows", "configs"):
        shutil.copytree(Path(REPO) / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(Path(REPO) / name, src / name)
    # --no-index: nothing is downloaded (setuptools is the project venv's, no build isolation)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp_path / "dist"), str(src)])
    wheel = next((tmp_path / "dist").glob("chatlearn_prefect-*.whl"))

    # a fresh venv with the wheel alone; torch, Ray, Prefect come from the project's venv through a .pth (never
    # re-downloaded). Its .pth files are not run from there, so the editable install's finder stays out
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    deps = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "_project_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          str(wheel)])
    built = time.monotonic() - t0

    work = tmp_path / "elsewhere"  # not the repository: no configs/ or data/ here
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CHATLEARN_OUTPUT_DIR", "CHATLEARN_TINY_MODEL_DIR", *FAULT_VARIABLES)}
    from prefect.settings import PREFECT_API_URL

    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    # what the new venv imports, and the packaged `grpo` resolved there (one interpreter start)
    # (flows is found, not imported: importing it loads Prefect, seconds for nothing here)
    probe = ("import importlib.util, json, chatlearn; from chatlearn.config import load_config; "
             "rt = load_config('grpo').runtime; "
             "print(json.dumps([chatlearn.__file__, importlib.util.find_spec('flows').origin, rt.data_path]))")
    chatlearn_file, flows_file, data_path = json.loads(_run([str(python), "-c", probe], cwd=work, env=env).stdout)
    assert Path(chatlearn_file) == site / "chatlearn" / "__init__.py"  # not the repository's (editable) one
    assert Path(flows_file) == site / "flows" / "__init__.py"
    assert data_path == str(site / "chatlearn" / "configs" / "data" / "max_digit_train.jsonl")

    t1 = time.monotonic()
    _run([str(venv / "bin" / "chatlearn"), "train", *SMALL], cwd=work, env=env, timeout=600)
    trained = time.monotonic() - t1
    # the default's relative paths: outputs and the tiny model under the working directory
    run_dir = work / "output" / "default"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["episode"] for row in rows] == [1]
    assert {"config.json", "model.safetensors"} <= {p.name for p in (run_dir / "final" / "policy").iterdir()}
    assert (work / "output" / "tiny-llama" / "config.json").is_file()
    print(f"wheel built and installed in {built:.1f} s, one episode in {trained:.1f} s")
