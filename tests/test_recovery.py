"""The train flow's restart loop (flows/train_flow.py `_train_locked`), without Ray: a lost model process is
retried `runtime.max_restarts` times from the last checkpoint, then one clear error; a lost node whose
capacity the layout needs fails naming it; other errors are never retried. The real SIGKILL of a model
process mid-episode, recovered to the undisturbed run's weights, is tests/test_resume.py."""

import importlib

import pytest

from chatlearn.config import load_config
from chatlearn.runtime.calls.recovery import ProcessLost
from chatlearn.runtime.cluster.placement import PlacementError
from chatlearn.runtime.prepared import PreparedRun
from chatlearn.utils.errors import RunError

train_flow = importlib.import_module("flows.train_flow")  # the module: `flows.train_flow` the name is the flow


@pytest.fixture
def attempts(monkeypatch, tmp_path):
    """Replace one start of the run with a script: each call pops the next outcome (an exception or a result)
    and records the config it was given."""
    script: list = []
    seen: list = []

    def attempt(prepared, run_dir, t_start, progress):
        seen.append(prepared.cfg)
        outcome = script.pop(0)
        if isinstance(outcome, BaseException):
            for key, value in getattr(outcome, "progress", {}).items():
                setattr(progress, key, value)
            raise outcome
        return outcome

    class Logger:
        def warning(self, msg):
            pass

    monkeypatch.setattr(train_flow, "_attempt", attempt)
    monkeypatch.setattr(train_flow, "claim_run_dir", lambda run_dir: None)  # a Prefect API call
    monkeypatch.setattr(train_flow, "get_run_logger", Logger)
    return script, seen


def run(tmp_path, *overrides):
    cfg = load_config(None, [f"runtime.output_dir={tmp_path}", *overrides])
    return train_flow._train_locked(PreparedRun(cfg, None, None), tmp_path / "run", 0.0)


def lost(episode: int, committed: bool, nodes=()) -> ProcessLost:
    exc = ProcessLost(f"model process 0-worker died during episode {episode}", ["0-worker"], list(nodes))
    exc.progress = {"episode": episode, "committed": committed}
    return exc


def test_lost_processes_are_retried_up_to_max_restarts_then_one_error(attempts, tmp_path, capsys):
    script, seen = attempts
    script += [lost(2, True), lost(3, True), {"done": True}]
    assert run(tmp_path, "runtime.max_restarts=2") == {"done": True}
    err = capsys.readouterr().err
    assert "restart 1 of at most 2" in err and "restart 2 of at most 2" in err
    # after a checkpoint of this run, restarts resume from it whatever the config said
    assert seen[0].runtime.enable_resume_training is True
    script += [lost(0, False), lost(0, False)]
    with pytest.raises(RunError) as err:
        run(tmp_path, "runtime.max_restarts=1", "runtime.enable_resume_training=false")
    assert str(err.value) == ("model process 0-worker died during episode 0; gave up after 1 restart(s) "
                              "(runtime.max_restarts)")
    assert seen[-1].runtime.enable_resume_training is False  # nothing committed yet: the run starts over


def test_a_lost_node_the_layout_needs_fails_naming_it(attempts, tmp_path):
    script, _ = attempts
    script += [lost(1, True, nodes=["3f2a00112233 (10.0.0.7)"]), PlacementError("models need 4 GPUs, 3 remain")]
    with pytest.raises(RunError) as err:
        run(tmp_path)
    assert str(err.value) == ("model process 0-worker died during episode 1; the model layout no longer fits the "
                              "remaining cluster: models need 4 GPUs, 3 remain")


def test_other_errors_are_not_retried(attempts, tmp_path):
    script, seen = attempts
    script += [RunError("episode 0, score: reward hook m:f raised ValueError: boom"), {"never": "reached"}]
    with pytest.raises(RunError, match="boom"):
        run(tmp_path)
    assert len(seen) == 1


def test_a_lost_local_ray_head_restarts_on_a_fresh_ray_and_a_joined_clusters_ends_the_run(attempts, tmp_path, capsys):
    # the run's own local Ray lost its head: a lost process of its own kind, retried the same way; a joined
    # cluster's head is not the run's to restart: the run ends at once (chatlearn.runtime.cluster.head)
    from chatlearn.runtime.calls.recovery import HeadLost
    from chatlearn.runtime.cluster.head import RayHeadGone

    script, seen = attempts
    head = HeadLost("the head of the local Ray went away during episode 3 (its gcs_server, pid 4242, killed by "
                    "SIGKILL); starting a fresh local Ray")
    head.progress = {"episode": 2, "committed": True}
    script += [head, {"done": True}]
    assert run(tmp_path) == {"done": True}
    assert ("chatlearn: warning: the head of the local Ray went away during episode 3 (its gcs_server, pid 4242, "
            "killed by SIGKILL); starting a fresh local Ray; recreating the model processes and resuming from the "
            "last checkpoint (restart 1 of at most 3)") in capsys.readouterr().err
    assert seen[-1].runtime.enable_resume_training is True
    script += [RayHeadGone("the Ray head at 10.0.0.7:6379 went away"), {"never": "reached"}]
    with pytest.raises(RayHeadGone):
        run(tmp_path)
    assert len(seen) == 3
