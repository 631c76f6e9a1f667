"""The `chatlearn` command: `config` prints the resolved config or lists every problem."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO

CLI = [sys.executable, "-m", "chatlearn.cli"]


def run(*args, env=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_config_prints_the_resolved_default_with_overrides():
    res = run("config", "runtime.num_episode=3", "models.policy.args_dict.max_new_tokens=2")
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)
    assert cfg["runtime"]["num_episode"] == 3
    assert cfg["runtime"]["output_dir"].endswith("default")  # output_dir/exp_name
    assert cfg["runtime"]["train_global_batch_size"] % cfg["runtime"]["train_micro_batch_size"] == 0
    assert set(cfg["models"]) == {"policy", "reference", "reward", "value", "ppo_policy", "ppo_value"}
    policy = cfg["models"]["policy"]
    assert policy["args_dict"]["max_new_tokens"] == 2
    assert policy["args_dict"]["tiny_model"]["hidden_size"] > 0  # from model_config_file
    # every field is printed, defaults filled in
    assert policy["lora"]["lora_dim"] == 8 and policy["batch_generation"]["ranking"] is False
    assert cfg["runtime"]["param_sync_comm_type"] == "broadcast"


def test_config_lists_all_problems_and_exits_nonzero():
    res = run("config", "runtime.train_global_batch_size=33", "models.policy.gpu_per_process=2",
              "models.ppo_policy.args_dict.lr=-1", "runtime.stream_data_loader_type=bogus")
    assert res.returncode == 2
    for path in ("runtime.train_global_batch_size", "models.policy.gpu_per_process",
                 "models.ppo_policy.args_dict.lr", "runtime.stream_data_loader_type"):
        assert path in res.stderr, (path, res.stderr)
    assert res.stdout == ""


def test_train_rejects_a_bad_config_before_starting_anything(tmp_path):
    res = run("train", "models.reward.args_dict.reward_fn=nowhere:fn", "runtime.sample_per_episode=0",
              env={"CHATLEARN_PREFECT_HOME": str(tmp_path)})
    assert res.returncode == 2
    assert "models.reward.args_dict" not in res.stderr or "reward_fn" in res.stderr
    assert "runtime.sample_per_episode" in res.stderr
    assert not (tmp_path / "server.json").exists()  # no Prefect server was started


def test_an_unimportable_reward_function_is_a_config_error():
    res = run("config", "models.reward.args_dict.reward_fn=chatlearn.tasks.max_digit:nope")
    assert res.returncode == 2
    assert "models.reward.args_dict.reward_fn:" in res.stderr and "has no attribute 'nope'" in res.stderr
