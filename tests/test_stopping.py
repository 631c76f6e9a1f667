"""No hang: SIGTERM stops a real `chatlearn train` within seconds, stops the Prefect server it started and
leaves the last checkpoint the resume point; a stage stuck past `runtime.stage_timeout_s` is one error line
naming the episode, the stage and the model."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

SMALL = ["runtime.sample_per_episode=32", "runtime.generation_batch_size=16", "runtime.train_micro_batch_size=8",
         "runtime.train_global_batch_size=16", "runtime.enable_eval_before_training=false"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_run_and_its_prefect_server_and_the_last_checkpoint_resumes(tiny_model_dir, tmp_path):
    home = tmp_path / "prefect"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the run starts its own server
    env.update(CHATLEARN_OUTPUT_DIR=str(tmp_path), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               CHATLEARN_PREFECT_HOME=str(home))
    args = [sys.executable, "-m", "chatlearn.cli", "train", *SMALL, "runtime.num_episode=50",
            "runtime.save_episode_interval=1", "runtime.eval_episode_interval=0", "runtime.exp_name=term"]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # two episodes done: a checkpoint exists
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    server = json.loads((home / "server.json").read_text())["pid"]
    assert _alive(server)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)  # a hang guard, not a benchmark: it stops in a few seconds
    stop_seconds = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "chatlearn: stopped by SIGTERM; re-run the same command to resume" in err
    assert "Traceback" not in err, err[-3000:]
    for _ in range(50):
        if not _alive(server):
            break
        time.sleep(0.1)
    assert not _alive(server), "the Prefect server the run started is still running"
    print(f"stopped {stop_seconds:.1f} s after SIGTERM")

    # the last committed checkpoint is intact: a re-run resumes from it and finishes
    done = len(metrics.read_text().splitlines())
    again = subprocess.run([*args[:-2], f"runtime.num_episode={done + 1}", "runtime.exp_name=term"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming after episode " in again.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["episode"] for r in rows] == list(range(done + 1))


def test_a_stuck_stage_is_an_error_naming_the_episode_stage_and_model(tiny_model_dir, tmp_path, prefect_api):
    from prefect.settings import PREFECT_API_URL

    (tmp_path / "stuck_reward.py").write_text(textwrap.dedent("""
        import time

        def reward(sample):
            time.sleep(600)  # a hook that never returns in time
            return 0.0
    """))
    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(tmp_path / "out"), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               PREFECT_API_URL=PREFECT_API_URL.value(), PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", *SMALL, "runtime.num_episode=1",
                          "runtime.eval_episode_interval=0", "runtime.stage_timeout_s=5",
                          "models.reward.args_dict.reward_fn=stuck_reward:reward",
                          "models.reward.args_dict.timeout_s=900"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("chatlearn: error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert "episode 0, score: no result after 5 s from reward (runtime.stage_timeout_s)" in errors[0], errors
    assert time.monotonic() - t0 < 280  # not the hook's 600 s


def test_the_stage_clock_names_the_models_that_did_not_answer(ray_session):
    import ray

    from chatlearn.runtime.waiting import StageClock, StageTimeout

    @ray.remote(num_cpus=0)
    def answer(seconds):
        time.sleep(seconds)
        return seconds

    clock = StageClock("train", 7, timeout_s=1.0)
    assert clock.get([answer.remote(0), answer.remote(0)], ["ppo_policy", "ppo_value"]) == [0, 0]
    with pytest.raises(StageTimeout) as err:
        clock.get([answer.remote(0), answer.remote(60)], ["ppo_policy", "ppo_value"])
    assert str(err.value) == ("episode 7, train: no result after 1 s from ppo_value (runtime.stage_timeout_s); "
                              "the model is stuck or the limit is too low")
