"""Experiment trackers (`runtime.log_args_dict`, chatlearn/runtime/records/trackers.py): what each tracker got is
read back with its own reader: TensorBoard's event accumulator, wandb's offline run file (its protobuf records)
and a real `mlflow server` on loopback through `MlflowClient`. A real run's trackers are checked in
tests/test_run_display.py; these tests drive the trackers as the train flow does, without Ray."""

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

import pytest

from chatlearn.config import load_config
from chatlearn.runtime.records.trackers import STATE_FILE, Trackers, flat_params, scalars


def rows(episodes):
    """Rows as `metrics.jsonl` holds them: the episode counted from 1."""
    return [{"episode": e, "reward_mean": 0.25 * e, "kl_mean": float("nan") if e == 2 else 0.01 * e,
             "stage_seconds": {"generate": 1.0 + e, "train": 2.0}, "eval_examples_seen": True, "note": "x",
             "checkpoint_paths": ["a"]} for e in episodes]


def samples(episode):
    """An episode's trace rows, as the StreamDataset makes them (`chatlearn.runtime.records.traces.trace_rows`)."""
    return [{"episode": episode, "sample_id": 4 * episode + i, "group_id": episode, "prompt": "max 1 | 2 ?",
             "response": str(i), "reward": float(i % 2), "advantage": i - 1.5, "policy_version": episode - 1,
             "staleness": 0, "trained": True} for i in range(4)]


def tracker_config(tmp_path, *overrides):
    return load_config(None, [f"runtime.output_dir={tmp_path}", "runtime.exp_name=tracked",
                              "runtime.log_args_dict.enable_tensorboard=true", *overrides])


# -- readers -------------------------------------------------------------------------------------------------


def tensorboard_scalars(path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series under a TensorBoard log dir: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path):
    """The protobuf records of a wandb offline run file (`run-<id>.wandb`): wandb's LevelDB-style log of
    32 KiB blocks, each record a 7-byte header (crc32, length, kind) and a chunk; kinds 1 (full) and 4 (last)
    end a record."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # the padding at a block's end
            pos += room
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_history(wandb_dir) -> tuple[set[str], dict[str, Any], list[dict[str, float]]]:
    """(run ids, config, history rows by step) of every offline run under a wandb dir."""
    ids, config, history = set(), {}, []
    for path in sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")):
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
            elif kind == "history":
                history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                for i in rec.history.item})
    return ids, config, history


def mlflow_run(uri, run_id):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return client, client.get_run(run_id)


# -- tests ---------------------------------------------------------------------------------------------------


def test_a_row_becomes_scalars_and_the_config_dotted_params():
    [row] = rows([2])
    row["kl_mean"] = 0.02
    assert scalars(row) == {"reward_mean": 0.5, "kl_mean": 0.02, "stage_seconds/generate": 3.0,
                            "stage_seconds/train": 2.0, "eval_examples_seen": 1.0}
    params = flat_params({"runtime": {"seed": 7, "colocation": ["a,b"], "data_path": None}, "models": {}})
    assert params == {"runtime.seed": "7", "runtime.colocation": '["a,b"]', "runtime.data_path": "null",
                      "models": "{}"}
    assert len(flat_params({"k": "x" * 9000})["k"]) == 6000  # MLflow's longest parameter value


def test_every_tracker_flag_names_a_registered_tracker():
    from chatlearn.config.runtime import LogArgsConfig
    from chatlearn.runtime.records.trackers import TRACKERS

    flags = [f.removeprefix("enable_") for f in LogArgsConfig.model_fields if f.startswith("enable_")]
    assert sorted(flags) == sorted(TRACKERS) == ["mlflow", "tensorboard", "wandb"]
    assert LogArgsConfig(enable_mlflow=True, enable_wandb=True).enabled == ["wandb", "mlflow"]


def test_the_log_section_is_checked_and_free_to_change(tmp_path):
    from chatlearn.checkpoint.run_config import FREE_FIELDS
    from chatlearn.config.errors import ConfigError

    cfg = tracker_config(tmp_path)
    assert cfg.runtime.log_args_dict.enabled == ["tensorboard"]
    with pytest.raises(ConfigError) as err:
        load_config(None, ["runtime.log_args_dict.enable_tensorbord=true"])
    assert err.value.problems == ["runtime.log_args_dict.enable_tensorbord: unknown key, not defined in "
                                  "LogArgsConfig; did you mean enable_tensorboard?"]
    with pytest.raises(ConfigError, match="wandb_resume"):
        load_config(None, ["runtime.log_args_dict.wandb_resume=sometimes"])
    assert "runtime.log_args_dict.*" in FREE_FIELDS  # turning a tracker on is no change to what a run trains


@pytest.mark.slow
def test_three_trackers_get_every_episode_and_a_resume_continues_their_runs(tmp_path, mlflow_server, monkeypatch):
    """Episodes 1-2, a crash after episode 2 logged (checkpoint at 1), a resume that re-runs 2 and runs 3: each
    tracker holds steps 1, 2, 3 once, in one run, with the config as parameters."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = tracker_config(tmp_path, "runtime.log_args_dict.enable_wandb=true",
                         "runtime.log_args_dict.enable_mlflow=true",
                         f"runtime.log_args_dict.mlflow_tracking_uri={mlflow_server}", "runtime.seed=7")
    run_dir = Path(cfg.runtime.run_dir)
    first = Trackers.open(cfg, run_dir)
    assert set(first.links) == {"tensorboard", "wandb", "mlflow"}
    assert first.links["mlflow"].startswith(f"{mlflow_server}/#/experiments/")
    for row in rows([1, 2]):
        first.log(row, samples(row["episode"]))
    first.close(failed=True)  # the crash
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["wandb_step"] == state["mlflow_step"] == state["tensorboard_step"] == 2

    again = Trackers.open(cfg, run_dir, first_episode=1)  # resumes from the checkpoint of episode 1
    for row in rows([2, 3]):
        again.log(row, samples(row["episode"]))
    again.close()
    assert json.loads((run_dir / STATE_FILE).read_text())["wandb_id"] == state["wandb_id"]

    tb = tensorboard_scalars(run_dir / "tensorboard")
    assert tb["reward_mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [s for s, _ in tb["stage_seconds/generate"]] == [1, 2, 3] and math.isnan(tb["kl_mean"][1][1])

    ids, config, history = wandb_history(run_dir / "wandb")
    assert ids == {state["wandb_id"]}  # both starts wrote to one wandb run
    assert config["runtime"]["seed"] == 7 and config["runtime"]["exp_name"] == "tracked"
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["reward_mean"] for h in history] == [0.25, 0.5, 0.75]

    client, run = mlflow_run(mlflow_server, state["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert client.get_experiment(run.info.experiment_id).name == "tracked"
    assert run.data.params["runtime.seed"] == "7"
    assert run.data.params["runtime.log_args_dict.enable_mlflow"] == "true"
    got = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in got) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "stage_seconds/train")] == [1, 2, 3]

    # each episode's samples: an MLflow table artifact, a wandb Table, a TensorBoard text table (issue 47)
    tables = sorted(f.path for f in client.list_artifacts(run.info.run_id, "traces"))
    assert tables == [f"traces/episode_{e:06d}.json" for e in (1, 2, 3)]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, tables[2], str(tmp_path))).read_text())
    assert table["columns"][:3] == ["episode", "sample_id", "group_id"] and len(table["data"]) == 4
    assert [h["samples/_type"] for h in history] == ["table-file"] * 3 and history[2]["samples/nrows"] == 4
    # (read as TensorBoard's UI reads text; the resumed run does not write episode 2's again: text is not purged)
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 2, 3]
    assert "highest advantage" in texts[2].tensor_proto.string_val[0].decode()
    assert "max 1 \\| 2 ?" in texts[2].tensor_proto.string_val[0].decode()  # a cell's | kept out of the columns


def test_a_tracker_that_cannot_start_or_fails_costs_one_warning(tmp_path, caplog, monkeypatch):
    """An unreachable MLflow server, a TensorBoard dir that is a file: a warning each at the start; a tracker that
    raises mid-run: one warning, then it is left out; the others go on."""
    import socket
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    (tmp_path / "a-file").write_text("not a directory")
    cfg = tracker_config(tmp_path, f"runtime.log_args_dict.tensorboard_dir={tmp_path / 'a-file'}",
                         "runtime.log_args_dict.enable_mlflow=true",
                         f"runtime.log_args_dict.mlflow_tracking_uri=http://127.0.0.1:{closed}")
    caplog.set_level(logging.WARNING, logger="chatlearn")
    t0 = time.monotonic()
    trackers = Trackers.open(cfg, cfg.runtime.run_dir)
    assert time.monotonic() - t0 < 60  # not MLflow's minutes of retries
    assert trackers.trackers == []
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert any(m.startswith("experiment tracker mlflow could not start") for m in warned)
    assert any(m.startswith("experiment tracker tensorboard could not start") for m in warned)
    assert all(m.endswith("the run goes on without it") for m in warned)

    class Flaky:
        name, link, calls = "flaky", "-", 0

        def log(self, step, values):
            Flaky.calls += 1
            raise ConnectionError("server went away")

        def close(self, failed):
            raise AssertionError("a dropped tracker is not closed")

    caplog.clear()
    good = tracker_config(tmp_path / "good")
    trackers = Trackers.open(good, good.runtime.run_dir)
    trackers.trackers.append(Flaky())
    for row in rows([1, 2, 3]):
        trackers.log(row)
    trackers.close()
    assert Flaky.calls == 1
    assert [r.getMessage() for r in caplog.records] == [
        "experiment tracker flaky failed at episode 1: ConnectionError: server went away; the run goes on without it"]
    assert [s for s, _ in tensorboard_scalars(Path(good.runtime.run_dir) / "tensorboard")["reward_mean"]] == [1, 2, 3]


def test_a_missing_tracker_package_names_the_extra(tmp_path, caplog, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = load_config(None, [f"runtime.output_dir={tmp_path}", "runtime.log_args_dict.enable_wandb=true"])
    caplog.set_level(logging.WARNING, logger="chatlearn")
    assert Trackers.open(cfg, cfg.runtime.run_dir).trackers == []
    [message] = [r.getMessage() for r in caplog.records]
    assert "experiment tracker wandb could not start: ModuleNotFoundError" in message
    assert "pip install 'chatlearn-prefect[trackers]'" in message
