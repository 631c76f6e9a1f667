"""A user's project outside the repository: the installed `chatlearn` command run there, with an engine of its
own (ChatLearn's documented style, on GRPO's models, its estimator the GRPO trainer's), a reward function, a
helper it imports, a module class next to the config and an eval hook in the file form, no PYTHONPATH; and its
run directory keeps its run (complete, refused, continued).

The driver imports the engine and the hooks for the checks, the Ray workers import the reward (fanned-out Ray
tasks) and unpickle the module class (the policy's actor), so both sides find the user's folders. A model config
file named without a folder is the packaged one, as an include is. The same command again says the run is
complete and changes nothing; a config that changes results is refused naming the fields and changes nothing; a
larger num_episode continues from the checkpoint the last episode always leaves.
"""

import json

import pytest

from tests.conftest import REPO, chatlearn_train, command_here

pytestmark = pytest.mark.integration

SMALL = ["runtime.sample_per_episode=16", "runtime.generation_batch_size=16", "runtime.train_micro_batch_size=16",
         "runtime.train_global_batch_size=16", "runtime.enable_eval_before_training=false",
         "runtime.eval_episode_interval=1"]

CONFIG = f"""includes: [{REPO}/configs/grpo.yaml]
runtime:
  engine: myengine.py:MyGRPO                        # next to this config
  eval_post_process_fn: hooks/evalhook.py:metrics   # the file form, relative to where the command runs
  exp_name: mine
models:
  policy:
    args_dict:
      module: mypolicy:MyPolicy                     # next to this config; its actor unpickles it on a worker
  reference:
    model_config_file: tiny_llama.yaml              # not beside this config: the packaged one
  reward:
    args_dict:
      reward_fn: myreward:quarter                   # next to this config; imports its neighbour
  ppo_policy:
    args_dict:
      module: chatlearn.models.hf.grpo_trainer:GRPOPolicyTrainer   # its estimator is the reward's default
"""

ENGINE = """import chatlearn


class MyGRPO(chatlearn.Engine):
    def __init__(self, policy, reference, reward, ppo_policy):
        def env_flow(batch):
            policy_out = policy.forward_step(batch)
            ref_out = reference.forward_step(policy_out)
            return reward.forward_step(policy_out, ref_out)

        def trainer_flow(batch):
            ppo_policy.train_step(batch)

        def eval_flow(batch):
            return reward.eval_forward(policy.eval_forward(batch))

        super().__init__(chatlearn.Environment(env_flow), chatlearn.Trainer(trainer_flow),
                         chatlearn.Evaluator(eval_flow))
        self.set_parameter_sync(ppo_policy, policy)
"""


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_project_outside_the_repository_with_its_own_code_keeps_its_run_directory(prefect_api, tiny_model_dir,
                                                                                     tmp_path):
    project = tmp_path / "project"
    write(project / "conf" / "run.yaml", CONFIG)
    write(project / "conf" / "myengine.py", ENGINE)
    write(project / "conf" / "reward_parts.py", "VALUE = 0.25\n")
    write(project / "conf" / "myreward.py", "from reward_parts import VALUE\n\n\ndef quarter(sample):\n"
                                            "    return VALUE\n")
    write(project / "conf" / "mypolicy.py", "from chatlearn.models.hf.policy import PolicyInference\n\n\n"
                                            "class MyPolicy(PolicyInference):\n    pass\n")
    write(project / "hooks" / "evalhook.py", "def metrics(results, context):\n"
                                             "    return {'eval_results_seen': len(results)}\n")
    out = tmp_path / "out"

    def train(*args, **variables):
        return chatlearn_train(["conf/run.yaml", *SMALL, *args], out, tiny_model_dir, cwd=str(project), **variables)

    def answered_here(*args):  # what the command says before it starts anything, asked in this process
        return command_here(["train", "conf/run.yaml", *SMALL, *args], project, forget_under=project,
                            CHATLEARN_OUTPUT_DIR=str(out), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir)

    first = train("runtime.num_episode=1", PREFECT_LOGGING_LEVEL="INFO")  # Prefect's default, not the suite's
    assert first.returncode == 0, first.stderr[-4000:]
    run_dir = out / "mine"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["episode"], r["reward_mean"], r["eval_results_seen"]) for r in rows] == [(1, 0.25, 128)]
    assert rows[0]["train_steps"] == 1  # it trained (a constant reward: zero group advantages)
    kept = {p: (run_dir / p).read_bytes() for p in ("metrics.jsonl", "final/policy/model.safetensors")}
    # the terminal as a user sees it (not a TTY here): no progress bar redraws, none of Prefect's per-flow INFO
    # lines (they are in run_dir/chatlearn.log; an episode's task runs log theirs at DEBUG, task_runs.py), one
    # line for the episode, a summary to end with
    assert "\r" not in first.stderr and "episodes:" not in first.stderr
    assert " | INFO " not in first.stderr and "Finished in state" not in first.stderr, first.stderr[-3000:]
    log = (run_dir / "chatlearn.log").read_text()
    assert "prefect.flow_runs - Flow run " in log
    # how the weights travel, in the log only: the policy's own class is colocated with the trainer
    assert "chatlearn - param sync ppo_policy->policy: an in-process copy (every receiving rank is in a trainer " \
           "process)" in log and "param sync" not in first.stderr
    assert [line for line in first.stdout.splitlines() if line.startswith("[episode ")] == [
        line for line in first.stdout.splitlines() if line.startswith("[episode 1/1] reward_mean=0.25 ")]
    summary = first.stderr.split("run summary\n", 1)[1].splitlines()
    assert summary[0].split() == ["episodes", "1", "of", "1", "(" + summary[0].split("(")[1].split()[0], "s", "of",
                                  "episodes)"]
    assert summary[1].split() == ["reward_mean", "0.25", "(episode", "1)"]
    assert ["run", "directory", str(run_dir)] in [line.split() for line in summary]
    assert ["final", "policy", f"{run_dir}/final/policy"] in [line.split() for line in summary]
    assert any(line.split()[:2] == ["Prefect", "UI"] and "/runs/flow-run/" in line for line in summary)

    # the same command again: complete, nothing started or written
    again = answered_here("runtime.num_episode=1")
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.splitlines() == [
        f"chatlearn: {run_dir} is complete: it trained 1 episode, runtime.num_episode is 1 (final policy: "
        f"{run_dir}/final/policy); nothing to do. A larger runtime.num_episode continues it; another "
        "runtime.exp_name starts a new run"]

    # another seed and learning rate in the same run directory: refused before anything starts, naming them
    other = answered_here("runtime.num_episode=1", "runtime.seed=7", "models.ppo_policy.args_dict.lr=1e-3")
    assert other.returncode == 2, other.stderr[-4000:]
    assert other.stderr.startswith(f"chatlearn: error: {run_dir} holds a run started with another config, which "
                                   "differs in 2 fields that change results: models.ppo_policy.args_dict.lr: "
                                   "0.0005 in the run, 0.001 now; runtime.seed: 42 in the run, 7 now."), other.stderr
    assert {p: (run_dir / p).read_bytes() for p in kept} == kept

    # a larger num_episode continues from the last episode's checkpoint (save_episode_interval is 10)
    longer = train("runtime.num_episode=2")
    assert longer.returncode == 0, longer.stderr[-4000:]
    assert "resuming after episode 1 (trainer iteration 1" in longer.stderr
    rows2 = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows2[0] == rows[0] and [r["episode"] for r in rows2] == [1, 2]
    record = json.loads((run_dir / "run_config.json").read_text())
    assert (record["status"], record["episodes_done"]) == ("finished", 2)
    assert [e["event"] for e in record["history"]] == ["started", "finished", "resumed", "finished"]
