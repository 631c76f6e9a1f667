"""A run directory keeps its run (chatlearn/checkpoint/run_config.py): what a start finds there, decided from the
record alone, before anything starts. The real runs (complete, refused, continued, from a folder outside the
repository) are in tests/test_outside_repo.py."""

import json
import os

import pytest

from chatlearn.checkpoint.run_config import (
    RunDirConflict,
    inspect_run_dir,
    read_record,
    record_progress,
    record_start,
    results_view,
)
from chatlearn.config import load_config
from tests.conftest import REPO


def config(tmp_path, *overrides):
    data = tmp_path / "prompts.jsonl"
    if not data.exists():
        data.write_text('{"prompt": "max 1 2 ?"}\n')
    return load_config(os.path.join(REPO, "configs", "grpo.yaml"),
                       [f"runtime.output_dir={tmp_path}", "runtime.exp_name=run", f"runtime.data_path={data}",
                        "runtime.num_episode=2", *overrides])


def finished(tmp_path, *overrides):
    """A run of `config(...)` that trained its episodes and ended."""
    cfg = config(tmp_path, *overrides)
    record_start(cfg, inspect_run_dir(cfg))
    record_progress(cfg, 1)
    record_progress(cfg, 2, final_policy="final/policy", finished=True)
    return cfg


def test_a_new_directory_starts_and_a_finished_run_is_complete(tmp_path):
    cfg = config(tmp_path)
    state = inspect_run_dir(cfg)
    assert state.record is None and not state.complete
    finished(tmp_path)
    record = read_record(cfg.runtime.run_dir)
    assert (record["status"], record["episodes_done"], record["final_policy"]) == ("finished", 2, "final/policy")
    assert record["config"]["runtime"]["seed"] == 42  # the resolved config, as `chatlearn config` prints it
    assert [e["event"] for e in record["history"]] == ["started", "finished"]
    again = inspect_run_dir(cfg)
    assert again.complete and not again.changes
    assert again.complete_message(cfg) == (
        f"{cfg.runtime.run_dir} is complete: it trained 2 episodes, runtime.num_episode is 2 (final policy: "
        "final/policy); nothing to do. A larger runtime.num_episode continues it; another runtime.exp_name starts "
        "a new run")
    # what does not change results may change: a longer run continues, other resources, logging, eval
    longer = config(tmp_path, "runtime.num_episode=5", "runtime.log_interval=3", "models.policy.num_cpu=4",
                    "runtime.eval_episode_interval=1", "runtime.save_episode_interval=2")
    state = inspect_run_dir(longer)
    assert not state.complete and not state.changes
    record_start(longer, state)
    assert [e["event"] for e in read_record(cfg.runtime.run_dir)["history"]] == ["started", "finished", "resumed"]
    # choosing an earlier record to resume from is never "complete"
    assert not inspect_run_dir(config(tmp_path, "runtime.load_data_checkpoint_iteration=2")).complete


def test_a_config_that_changes_results_is_refused_naming_the_fields(tmp_path):
    finished(tmp_path)
    with pytest.raises(RunDirConflict) as err:
        inspect_run_dir(config(tmp_path, "runtime.seed=7", "models.ppo_policy.args_dict.lr=0.001"))
    assert str(err.value) == (
        f"{tmp_path}/run holds a run started with another config, which differs in 2 fields that change results: "
        "models.ppo_policy.args_dict.lr: 0.0005 in the run, 0.001 now; runtime.seed: 42 in the run, 7 now. To keep "
        "both, give this one another runtime.exp_name (or runtime.output_dir); to continue that run with the new "
        "values, add --resume-with-changes (runtime.resume_with_changes=true), and its run_config.json records "
        "the change")
    # the data counts by its contents, not only its path
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "max 3 4 ?"}\n')
    with pytest.raises(RunDirConflict, match=r"differs in 1 field that change results: runtime.data_path contents "):
        inspect_run_dir(config(tmp_path))


def test_continuing_with_changes_is_recorded(tmp_path):
    cfg = finished(tmp_path)
    changed = config(tmp_path, "runtime.seed=7", "runtime.num_episode=3", "runtime.resume_with_changes=true")
    state = inspect_run_dir(changed)
    assert state.changes == {"runtime.seed": [42, 7]} and not state.complete
    record_start(changed, state)
    record = read_record(cfg.runtime.run_dir)
    assert record["history"][-1]["event"] == "resumed with changes (runtime.resume_with_changes)"
    assert record["history"][-1]["changes"] == {"runtime.seed": [42, 7]}
    assert record["config"]["runtime"]["seed"] == 7 and record["view"] == results_view(changed)
    # the new values are now the run's: the same start again needs no flag
    assert inspect_run_dir(config(tmp_path, "runtime.seed=7", "runtime.num_episode=3")).changes == {}


def test_starting_over_is_said_and_recorded(tmp_path):
    cfg = finished(tmp_path)
    over = config(tmp_path, "runtime.enable_resume_training=false", "runtime.seed=7")
    state = inspect_run_dir(over)  # ChatLearn's switch for a fresh start: not refused, not complete
    assert state.start_over == "runtime.enable_resume_training: false" and not state.complete
    record_start(over, state)
    record = read_record(cfg.runtime.run_dir)
    assert (record["status"], record["episodes_done"], record["config"]["runtime"]["seed"]) == ("running", 0, 7)
    assert [e["event"] for e in record["history"]] == [
        "started", "finished", "started over (runtime.enable_resume_training: false)", "started"]
    # a run that committed no episode yet (stopped before its first checkpoint) has nothing to keep: another
    # config starts over instead of being refused
    other = config(tmp_path, "runtime.seed=8")
    state = inspect_run_dir(other)
    assert state.start_over == "another config, and the run committed no episode"
    assert state.changes == {"runtime.seed": [7, 8]}
    record_start(other, state)
    assert read_record(cfg.runtime.run_dir)["history"][-2]["replaced"] == {"episodes_done": 0,
                                                                           "changes": {"runtime.seed": [7, 8]}}


def test_a_damaged_record_is_named(tmp_path):
    cfg = config(tmp_path)
    os.makedirs(cfg.runtime.run_dir)
    (tmp_path / "run" / "run_config.json").write_text("{not json")
    with pytest.raises(RunDirConflict, match=r"run_config.json: unreadable run record .*move it away"):
        inspect_run_dir(cfg)
    (tmp_path / "run" / "run_config.json").write_text(json.dumps([1]))
    with pytest.raises(RunDirConflict, match=r"run_config.json: not a run record"):
        inspect_run_dir(cfg)
