"""Errors from user code read as one line (issue 12, item 5).

A reward, relay or eval hook that raises or returns something unusable is a `RunError` naming the hook (and the
sample, for a reward hook); the stage that ran it adds the episode and the stage (``episode 1, score: ...``)
whatever Ray wrapped it in; the CLI prints ``chatlearn: error: <message>`` and exits 1, and the tracebacks
Prefect logs go to ``run_dir/chatlearn.log`` instead of the terminal. Any other exception keeps its traceback.
Unit tests without Ray, one with the session Ray (an error crossing a Ray task), and one in-process run whose
reward hook raises (the terminal side of a real run is `tests/test_nonfinite.py`'s subprocess run).
"""

import io
import logging
import os

import pytest
import torch

from chatlearn.data.relay import RelayBuffer, RelayHookError
from chatlearn.models.rule import RewardError, hook_name, score_samples
from chatlearn.runtime.calls.handles import RefBox
from chatlearn.runtime.records.console import LOG_NAME, run_log
from chatlearn.runtime.records.evaluation import eval_metrics
from chatlearn.utils.errors import RunError, find_run_error
from flows.stage_tasks import in_stage, stage_error
from tests.conftest import REPO

HERE = __name__  # how pytest imported this module: the hooks below are named by it
SAMPLES = [{"sample_id": 2, "prompt": "max 1 2 ?", "response": "2", "answer": "2"},
           {"sample_id": 3, "prompt": "max 7 3 ?\nsecond line", "response": "1", "answer": "7"}]


# hooks, importable by name (also from Ray workers: they get the driver's sys.path)

def boom_reward(sample):
    if sample["sample_id"] == 3:
        raise ValueError("boom")
    return 0.5


def boom_relay(buffers):
    raise ValueError("boom\nwith a second line")


def floats_relay(buffers):
    return [1.0]


def boom_eval(results, context):
    raise KeyError("eval_answer")


def list_eval(results, context):
    return [1.0]


def nan_eval(results, context):
    return {"eval_accuracy": float("nan")}


def ray_task_error(cause: BaseException) -> BaseException:
    """``cause`` as Ray hands it to the caller of a failed task: a RayTaskError that is also its class."""
    from ray.exceptions import RayTaskError

    return RayTaskError("rule-reward", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


# -- the hooks' errors -----------------------------------------------------------------------------------------

def test_a_reward_hook_that_raises_names_the_hook_the_sample_and_the_exception():
    with pytest.raises(RewardError) as info:
        score_samples(boom_reward, SAMPLES, 5, hook_name(f"{HERE}:boom_reward"), episode_start=0)
    assert isinstance(info.value, RunError)
    # the prompt is JSON-quoted: its newline stays on the message's one line
    assert str(info.value) == (f"reward hook {HERE}:boom_reward raised ValueError: boom for sample 3 "
                               '(prompt "max 7 3 ?\\nsecond line")')
    assert isinstance(info.value.__cause__, ValueError)  # the hook's traceback, for the log file
    with pytest.raises(RewardError, match=r"^reward hook m:f took longer than timeout_s=0.2s for sample_id 2 "):
        score_samples(lambda s: __import__("time").sleep(3), SAMPLES, 0.2, hook_name("m:f"))


def test_a_relay_hook_that_raises_or_returns_a_non_list_is_one_line():
    samples = [{"x": torch.tensor(1.0)}]
    with pytest.raises(RelayHookError) as info:
        RelayBuffer(2, 0, boom_relay).add_episode(0, samples)
    assert isinstance(info.value, RunError) and isinstance(info.value, TypeError)
    assert str(info.value) == (f"relay hook {HERE}:boom_relay raised ValueError: boom with a second line "
                               "(episodes [0] in the window)")
    with pytest.raises(RelayHookError, match=rf"^relay hook {HERE}:floats_relay must return a list of sample "
                                             r"dicts; item 0 is a float$"):
        RelayBuffer(2, 0, floats_relay).add_episode(0, samples)


def test_an_eval_hook_that_raises_or_returns_a_non_dict_is_one_line():
    results = [{"prompt": "a", "scores": 1.0}, {"prompt": "b", "scores": 0.0}]
    with pytest.raises(RunError, match=rf"^eval hook {HERE}:boom_eval raised KeyError: 'eval_answer' \(on 2 eval "
                                       r"results\)$"):
        eval_metrics(results, {}, f"{HERE}:boom_eval")
    with pytest.raises(RunError, match=rf"^eval hook {HERE}:list_eval must return a dict of metrics by name, got "
                                       r"\[1\.0\]$"):
        eval_metrics(results, {}, f"{HERE}:list_eval")
    metrics = eval_metrics(results, {}, f"{HERE}:nan_eval")  # a NaN metric trains nothing: written as null
    assert metrics["eval_reward_mean"] == 0.5 and metrics["eval_accuracy"] != metrics["eval_accuracy"]


# -- the stage adds where ------------------------------------------------------------------------------------

def test_the_stage_unwraps_ray_and_says_episode_and_stage():
    hook = RewardError("reward hook m:f returned nan for sample 17 (prompt \"max\"); expected a finite number")
    wrapped = ray_task_error(hook)
    assert str(wrapped) != hook.message and find_run_error(wrapped) is not None
    err = stage_error(wrapped, "score", 3)
    # the episode counted from 1, as the terminal's [episode N/M] (3 is the fourth episode's index)
    assert type(err) is RunError and err.message == f"episode 4, score: {hook.message}"
    assert stage_error(err, "score", 3) is err  # said where already: unchanged
    assert stage_error(ray_task_error(err), "train", 3).message == err.message
    assert stage_error(hook, "eval", -1).message == f"eval: {hook.message}"  # no episode: before training, eval
    assert stage_error(ValueError("a bug of ours"), "score", 3) is None  # keeps its own traceback
    try:
        try:
            raise hook
        except RunError as exc:
            raise KeyError("while handling") from exc
    except KeyError as chained:
        assert stage_error(chained, "sync", 0).message.startswith("episode 1, sync: reward hook m:f")


def test_in_stage_finds_the_episode_in_its_arguments_or_the_rollouts():
    @in_stage("score")
    def score(run, rollouts):
        raise ray_task_error(RelayHookError("relay hook m:f raised ValueError: boom"))

    @in_stage("train")
    def train(run, experience, episode, start_iteration):
        raise ValueError("a bug of ours")

    with pytest.raises(RunError, match=r"^episode 3, score: relay hook m:f raised ValueError: boom$") as info:
        score(None, RefBox([], episode=2))
    assert info.value.__cause__ is not None  # the Ray error, with the remote traceback, for the log file
    with pytest.raises(ValueError, match="a bug of ours"):
        train(None, RefBox([]), episode=1, start_iteration=0)
    assert score.__name__ == "score" and score.__prefect_task_source__.__name__ == "score"


@pytest.mark.integration
def test_a_relay_hook_error_crosses_ray_as_one_line(ray_session):
    import json

    import ray

    # the relay window lives in an actor (the run's StreamDataset); json.loads of a list raises, as a user's
    # hook would, and is importable in the workers (this module is not: pytest imported it by file)
    relay = ray.remote(RelayBuffer).options(num_cpus=0).remote(2, 0, json.loads)
    try:
        with pytest.raises(Exception) as info:
            ray.get(relay.add_episode.remote(1, [{"x": 1.0}]))
    finally:
        ray.kill(relay)
    assert "ray::RelayBuffer.add_episode()" in str(info.value)  # Ray's own str() is the remote traceback
    err = stage_error(info.value, "train", 1)
    assert err.message == ("episode 2, train: relay hook json:loads raised TypeError: the JSON object must be str, "
                           "bytes or bytearray, not list (episodes [1] in the window)")


# -- the CLI and the terminal ----------------------------------------------------------------------------------

def test_the_cli_prints_a_run_error_as_one_line_and_a_bug_with_its_traceback(capsys, monkeypatch):
    from chatlearn import cli

    message = 'episode 0, score: reward hook m:f raised ValueError: boom for sample 3 (prompt "max 7 3 ?")'

    def fails(items, verbose=False):
        raise ray_task_error(RunError(message))

    monkeypatch.setattr(cli, "cmd_train", fails)
    assert cli.main(["train"]) == 1
    out = capsys.readouterr()
    assert out.err == f"chatlearn: error: {message}\n" and out.out == ""

    def bug(items, verbose=False):
        raise ZeroDivisionError("ours")

    monkeypatch.setattr(cli, "cmd_train", bug)
    with pytest.raises(ZeroDivisionError):
        cli.main(["train"])


def test_run_log_keeps_a_run_errors_tracebacks_off_the_terminal(tmp_path):
    terminal = io.StringIO()
    console = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(console)
    prefect_log = logging.getLogger("prefect.chatlearn_test")  # Prefect's name space, without its API handler
    err = RunError("episode 0, score: reward hook m:f raised ValueError: boom for sample 3")
    try:
        with pytest.raises(RunError), run_log(tmp_path / "run") as path:
            assert path == tmp_path / "run" / LOG_NAME
            logging.getLogger("other").warning("a warning shows")
            try:
                raise ZeroDivisionError("a bug of ours")
            except ZeroDivisionError:
                logging.getLogger("other").exception("a bug shows with its traceback")
            try:
                raise ray_task_error(err)
            except RunError as wrapped:
                prefect_log.error("Encountered exception during execution: %r", wrapped, exc_info=True)
            prefect_log.error("Finished in state Failed('Flow run encountered an exception: RunError: ...')")
            prefect_log.error("Finished in state NotReady('Upstream task run did not reach a COMPLETED state')")
            prefect_log.warning("Finished in state Completed()")
            raise err
        assert console.filters == [] and all(h.__class__ is not logging.FileHandler for h in root.handlers)
    finally:
        root.removeHandler(console)
    shown = terminal.getvalue()
    assert "a warning shows" in shown and "ZeroDivisionError: a bug of ours" in shown
    assert "Finished in state Completed()" in shown
    assert "RunError" not in shown and "Finished in state Failed" not in shown and "NotReady" not in shown
    log = (tmp_path / "run" / LOG_NAME).read_text()
    assert "Encountered exception during execution" in log and "Finished in state Failed" in log
    assert log.count("Traceback") == 3  # the bug, Prefect's record, and the run's end
    assert "chatlearn - the run stopped: episode 0, score: reward hook m:f raised ValueError: boom" in log


def test_run_log_keeps_a_lost_processs_tracebacks_off_the_terminal(tmp_path):
    """What Prefect logs while a model process killed mid-episode fails the episode (Ray's ActorDiedError, raised
    in a stage task or wrapped by a later one, and the runs' "Finished in state" lines) goes to the log file
    only: the train flow says it in one warning line as it recovers (the real kill: tests/test_resume.py)."""
    from ray.exceptions import ActorDiedError

    terminal = io.StringIO()
    console = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(console)
    prefect_log = logging.getLogger("prefect.chatlearn_test")
    try:
        with run_log(tmp_path / "run"):
            for exc in (ActorDiedError(), RuntimeError("episode 3, score: a stage failed")):
                if isinstance(exc, RuntimeError):  # a later layer's error, raised from the death
                    exc.__cause__ = ActorDiedError()
                try:
                    raise exc
                except Exception:
                    prefect_log.error("Task run failed with exception: %r", exc, exc_info=True)
            prefect_log.error("Finished in state Failed('Task run encountered an exception ActorDiedError: ...')")
            prefect_log.error("Finished in state NotReady('Upstream task run did not reach a COMPLETED state')")
            logging.getLogger("chatlearn").warning("model process 0-worker died during episode 3; recreating ...")
    finally:
        root.removeHandler(console)
    assert terminal.getvalue() == "model process 0-worker died during episode 3; recreating ...\n"
    log = (tmp_path / "run" / LOG_NAME).read_text()
    assert log.count("Traceback") == 2 and log.count("ActorDiedError") >= 3 and "NotReady" in log


# -- a real run, in process ----------------------------------------------------------------------------------

@pytest.mark.integration
def test_a_reward_hook_that_raises_stops_the_run_with_the_episode_stage_hook_and_sample(
        prefect_api, ray_session, tiny_model_dir, tmp_path, monkeypatch):
    from chatlearn.config import load_config
    from flows import train_flow

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    cfg = load_config(os.path.join(REPO, "configs", "default.yaml"), [
        "runtime.num_episode=1", "runtime.sample_per_episode=16", "runtime.generation_batch_size=8",
        "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.eval_episode_interval=0",
        "runtime.enable_eval_before_training=false", f"runtime.output_dir={tmp_path}", "runtime.exp_name=hook",
        # by its package name: the rule's Ray tasks import it (their sys.path has the repository, not tests/)
        f"models.policy.args_dict.model_path={tiny_model_dir}", "models.reward.args_dict.reward_fn="
        "tests.test_user_errors:boom_reward",
    ])
    with pytest.raises(RunError) as info:
        train_flow(cfg)
    assert type(info.value) is RunError  # what the CLI finds and prints
    message = info.value.message
    assert message.startswith("episode 1, score: reward hook tests.test_user_errors:boom_reward raised ValueError: "
                              'boom for sample 3 (prompt "'), message
    assert "\n" not in message and not (tmp_path / "hook" / "final").exists()
