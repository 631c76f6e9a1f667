"""The `chatlearn` command: `config` prints the resolved config or lists every problem."""

import json
import os
import subprocess
import sys

import pytest

from chatlearn.cli import main
from chatlearn.config.loader import default_config_path
from tests.conftest import REPO

CLI = [sys.executable, "-m", "chatlearn.cli"]


def run(*args, env=None):
    """The real command in its own process."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=dict(os.environ, **(env or {})))


def run_here(capsys, *args):
    """The same command in this process (no interpreter and torch start-up): (exit code, stdout, stderr)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


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
              "runtime.stream_data_loader_type=bogus")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "chatlearn: invalid config (3 problem(s)):",
        "  - runtime.train_global_batch_size: must be a multiple of train_micro_batch_size (32), got 33",
        "  - runtime.stream_data_loader_type: must be one of 'fixed', 'dynamic' (case-insensitive), got 'bogus'",
        "  - models.policy.gpu_per_process: 2 exceeds num_gpu (0)",
    ]
    assert res.stdout == ""


def test_check_adds_the_engine_checks_in_the_same_list(capsys):
    args = ("runtime.train_global_batch_size=33", "models.ppo_policy.args_dict.lr=-1",
            "models.reward.args_dict.reward_fn=chatlearn.tasks.max_digit:nope")
    assert run_here(capsys, "config", *args[1:])[0] == 0  # ChatLearn's loader has no opinion on args_dict
    code, _, err = run_here(capsys, "config", "--check", *args)
    assert code == 2
    problems = [line[4:] for line in err.splitlines()[1:]]
    assert [p.split(": ")[0] for p in problems] == [
        "runtime.train_global_batch_size", "models.reward.args_dict.reward_fn", "models.ppo_policy.args_dict.lr"]
    assert "has no attribute 'nope'" in problems[1]
    assert problems[2] == "models.ppo_policy.args_dict.lr: Input should be greater than 0"


@pytest.mark.slow
def test_train_rejects_a_bad_config_before_starting_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(tmp_path))
    code, _, err = run_here(capsys, "train", "models.reward.args_dict.reward_fn=nowhere:fn",
                            "runtime.sample_per_episode=0")
    assert code == 2
    assert "  - runtime.sample_per_episode: must be > 0, got 0" in err.splitlines()
    # where it looked: the command's directory and the config's folder (the embedded default's)
    assert "  - models.reward.args_dict.reward_fn: 'nowhere:fn': cannot import module 'nowhere': no module named " \
           f"'nowhere': not installed, and no nowhere.py or nowhere/ in {REPO} (the current directory), " \
           f"{os.path.dirname(default_config_path())}" in err.splitlines()
    assert not (tmp_path / "server.json").exists()  # no Prefect server was started


def test_a_knob_that_a_module_cannot_honour_is_refused_by_the_checks_only(capsys):
    # chatlearn config still prints it (ChatLearn's loader accepts it) ...
    code, out, err = run_here(capsys, "config", "models.ppo_value.lora.enable_lora=true")
    assert code == 0, err
    assert json.loads(out)["models"]["ppo_value"]["lora"]["enable_lora"] is True
    # ... and what would run it refuses it, naming the field: the value trainer trains no adapters
    code, _, err = run_here(capsys, "config", "--check", "models.ppo_value.lora.enable_lora=true")
    assert code == 2
    problems = [line[4:] for line in err.splitlines()[1:]]
    assert problems == [
        "models.ppo_value.lora.enable_lora: PPOValueTrainer does not train LoRA adapters (the policy trainers do: "
        "ppo_policy of the rlhf, grpo, dpo and online_dpo engines)",
    ]
    # the policy trainer does
    code, _, err = run_here(capsys, "config", "--check", "models.ppo_policy.lora.enable_lora=true")
    assert code == 0, err


@pytest.mark.slow
def test_a_knob_that_only_tunes_speed_warns_once_and_runs():
    # in its own process: Python shows a warning once per place, so only a fresh process proves "once"
    res = run("config", "--check", "models.policy.batch_generation.min_prompt_length=4",
              "runtime.colocation=[]", "models.value.free_memory=true")
    assert res.returncode == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("chatlearn: warning:")]
    assert warnings == [
        "chatlearn: warning: models.policy.batch_generation.min_prompt_length=4 has no effect here: Megatron's first "
        "generation stage; Hugging Face generate has none",
        "chatlearn: warning: models.value.free_memory=True has no effect here: value is not in a colocation group "
        "(ChatLearn offloads only colocated models)",
    ]


GPU_LAYOUT = ["runtime.colocation=['policy,reference,reward,value']", "runtime.generation_batch_size=32",
              "models.policy.num_gpu=4", "models.reference.num_gpu=2", "models.reward.num_gpu=2",
              "models.value.num_gpu=2", "models.ppo_policy.num_gpu=1", "models.ppo_value.num_gpu=1"]


def test_plan_prints_chatlearns_placement_without_ray(capsys):
    code, out, err = run_here(capsys, "plan", "--nodes", "2", "--gpus-per-node", "4", *GPU_LAYOUT)
    assert code == 0, err
    plan = json.loads(out)
    third, half = {"share": 0.333333}, {"share": 0.5}

    def rank(node, device, process, share=None):
        return {"node": node, "device": device, "share": 1.0, "process": process, **(share or {})}

    # packs [policy], [reference, reward], [value]: devices 0-1 hold policy+reference+value, 2-3 policy+reward
    assert plan["models"]["policy"]["replicas"] == [[rank(0, 0, 0, third)], [rank(0, 1, 1, third)],
                                                    [rank(0, 2, 2, half)], [rank(0, 3, 3, half)]]
    assert plan["models"]["reference"]["replicas"] == [[rank(0, 0, 0, third)], [rank(0, 1, 1, third)]]
    assert plan["models"]["value"]["replicas"] == [[rank(0, 0, 0, third)], [rank(0, 1, 1, third)]]
    assert plan["models"]["reward"]["replicas"] == [[rank(0, 2, 2, half)], [rank(0, 3, 3, half)]]
    # node 0 is full: the trainers go to node 1
    assert plan["models"]["ppo_policy"] == {"num_replica": 1, "replicas": [[rank(1, 0, 4)]]}
    assert plan["models"]["ppo_value"] == {"num_replica": 1, "replicas": [[rank(1, 1, 5)]]}
    assert (plan["devices_required"], plan["devices_available"]) == (6, 8)
    assert "2 of 8 GPUs are not used by any model" in err


def test_plan_and_train_refuse_a_cluster_too_small_with_the_same_error(capsys, tmp_path):
    code, _, err = run_here(capsys, "plan", "--gpus-per-node", "0", *GPU_LAYOUT)
    assert code == 2
    assert err.splitlines() == [
        "chatlearn: placement: the config needs more than the cluster has: GPUs: 6 required, 0 available (1 node(s): "
        "0 GPUs); per model: colocation group 'policy,reference,reward,value' 4 (policy 4, reference 2, reward 2, "
        "value 2); ppo_policy 1; ppo_value 1"]


def test_train_refuses_a_layout_this_machine_cannot_hold_in_one_line_before_anything_starts(capsys, tmp_path,
                                                                                             monkeypatch):
    """A local run knows the machine's devices (here 2 declared GPUs): the plan is checked before the Prefect
    server, Ray or the run directory exist, and the terminal shows the one line."""
    import chatlearn.runtime.records.prefect_server as prefect_server

    def started(*args, **kwargs):
        raise AssertionError("the Prefect server was started")

    monkeypatch.setattr(prefect_server, "local_prefect_api", started)
    monkeypatch.setenv("CHATLEARN_FAKE_GPUS", "2")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, _, err = run_here(capsys, "train", *GPU_LAYOUT, f"runtime.output_dir={tmp_path}")
    assert code == 2
    assert err.splitlines() == [
        "chatlearn: placement: the config needs more than the cluster has: GPUs: 6 required, 2 available (1 node(s): "
        "2 GPUs); per model: colocation group 'policy,reference,reward,value' 4 (policy 4, reference 2, reward 2, "
        "value 2); ppo_policy 1; ppo_value 1"]
    assert not (tmp_path / "default").exists()


@pytest.mark.parametrize("command", ["train", "eval", "config", "plan", "deploy", "serve", "server", "export"])
def test_every_command_documents_its_options_and_an_example(command, capsys):
    from chatlearn.cli import _parser

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert f"example:\n  chatlearn {command}" in text
    sub = _parser()._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.option_strings and action.dest != "help":
            assert action.help, f"{command} {action.option_strings} has no help"


def test_deploy_flags_are_validated_as_the_config_deployment_section(capsys):
    code, _, err = run_here(capsys, "deploy", "--cron", "61 * * * *", "--on-overlap", "queue", "--name", "x")
    assert code == 2
    assert "deployment.cron: Invalid cron string" in err
