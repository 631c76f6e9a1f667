"""No hang: a stage stuck past `runtime.stage_timeout_s` is one error line naming the episode, the stage and
the model; SIGTERM while Ray starts is the same stop as at any other time. (SIGTERM of a real run, mid-run and
during its start-up, is tests/test_local_run.py.)"""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO

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


@pytest.mark.integration
def test_a_stuck_stage_is_an_error_naming_the_episode_stage_and_model(tiny_model_dir, tmp_path, prefect_api,
                                                                      ray_session):
    from prefect.settings import PREFECT_API_URL

    (tmp_path / "stuck_reward.py").write_text(textwrap.dedent("""
        import time

        def reward(sample):
            time.sleep(600)  # a hook that never returns in time
            return 0.0
    """))
    # the command's terminal is what is tested: it joins the session's Ray (its stuck task ends with the command,
    # as a finished driver's tasks do), and ships its PYTHONPATH to the workers
    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(tmp_path / "out"), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               PREFECT_API_URL=PREFECT_API_URL.value(), PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}",
               RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", *SMALL, "runtime.num_episode=1",
                          "runtime.eval_episode_interval=0", "runtime.stage_timeout_s=5",
                          "models.reward.args_dict.reward_fn=stuck_reward:reward",
                          "models.reward.args_dict.timeout_s=900"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("chatlearn: error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert "episode 1, score: no result after 5 s from reward (runtime.stage_timeout_s)" in errors[0], errors
    assert time.monotonic() - t0 < 280  # not the hook's 600 s


@pytest.mark.integration
def test_the_stage_clock_names_the_models_that_did_not_answer(ray_session):
    import ray

    from chatlearn.runtime.calls.waiting import StageClock, StageTimeout

    @ray.remote(num_cpus=0)
    def answer(seconds):
        time.sleep(seconds)
        return seconds

    clock = StageClock("train", 7, timeout_s=1.0)
    assert clock.get([answer.remote(0), answer.remote(0)], ["ppo_policy", "ppo_value"]) == [0, 0]
    with pytest.raises(StageTimeout) as err:
        clock.get([answer.remote(0), answer.remote(60)], ["ppo_policy", "ppo_value"])
    assert str(err.value) == ("episode 8, train: no result after 1 s from ppo_value (runtime.stage_timeout_s); "
                              "the model is stuck or the limit is too low")
    # a replica call waits on every rank: rank 0's result comes back, a stuck rank 1 is named by its model,
    # a failed rank 1 raises its error (nothing is left to settle later)
    from chatlearn.runtime.calls.handles import Call

    @ray.remote(num_cpus=0)
    def fail():
        raise ValueError("rank 1 broke")

    assert StageClock("generate", 0, timeout_s=30.0).get(Call("policy", [answer.remote(1), answer.remote(0)])) == 1
    with pytest.raises(StageTimeout, match="from policy "):
        StageClock("generate", 0, timeout_s=1.0).get([Call("policy", [answer.remote(0), answer.remote(60)])])
    with pytest.raises(ValueError, match="rank 1 broke"):
        StageClock("generate", 0, timeout_s=30.0).get(Call("policy", [answer.remote(0), fail.remote()]))


def test_sigterm_while_ray_starts_is_the_same_stop():
    """`ray.init` installs a SIGTERM handler of its own while it starts Ray (``sys.exit(signum)``: exit status 15,
    no line, and `launch` never learns it should take down what Ray started); `keep_handlers` turns that exit
    into the run's stop and puts the run's handler back."""
    from chatlearn.runtime.calls import stopping

    with stopping.stop_on_signals():
        ours = signal.getsignal(signal.SIGTERM)
        with pytest.raises(stopping.Stopped) as stop, stopping.keep_handlers():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init installs
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert stop.value.signame == "SIGTERM"
        assert stopping.stopping() and stopping.stop_signal() == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) is ours


def test_a_stop_ends_with_its_scope_and_what_escapes_a_stopped_scope_is_the_stop():
    """A stop flag left set after its run would stop the next run in the same process at its first stage (a
    second `chatlearn.cli.main` in a notebook; here it once aborted the test session from a later test)."""
    from chatlearn.runtime.calls import stopping

    with pytest.raises(stopping.Stopped) as stop, stopping.stop_on_signals():
        with contextlib.suppress(stopping.Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert stopping.stopping()
        raise RuntimeError("an actor killed for the stop")  # what a stop breaks on its way out
    assert stop.value.signame == "SIGTERM" and isinstance(stop.value.__cause__, RuntimeError)
    assert not stopping.stopping() and stopping.stop_signal() is None
    with pytest.raises(RuntimeError, match="not a stop"), stopping.stop_on_signals():
        raise RuntimeError("not a stop")
