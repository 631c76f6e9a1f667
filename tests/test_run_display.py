"""What a run shows: the reward / KL / eval curve (`curves.png` and its artifact), one metrics table artifact per
run updated in place, torch profiler traces (`runtime.profiler_dir`) and NVTX ranges (`runtime.nsys`).

The unit tests need neither Ray nor Prefect; the one integration test is a real 2-episode PPO run that checks
all of it at once."""

import asyncio
import base64
import json
import logging
import math
import re
import struct

import pytest
import torch

from chatlearn.runtime.records.profiling import StageMarks, nvtx_range, nvtx_works, stage_of, trace_name
from chatlearn.runtime.records.reporting import CURVE_DPI, CURVE_SIZE, curves_png, json_safe, table_rows, write_curves

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WIDTH, HEIGHT = round(CURVE_SIZE[0] * CURVE_DPI), round(CURVE_SIZE[1] * CURVE_DPI)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, which always comes first."""
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def ppo_rows(n):
    rows = [{"episode": i, "reward_mean": 0.1 * i, "kl_mean": 0.01 * i, "policy_loss": 0.5} for i in range(n)]
    for r in rows[1::2]:
        r["eval_reward_mean"] = 0.2 * r["episode"]
    if rows:
        rows[0]["eval_reward_mean_before_training"] = 0.0
    return rows


def test_the_curve_is_a_small_png():
    png = curves_png(ppo_rows(5))
    assert png_size(png) == (WIDTH, HEIGHT) == (480, 280)
    assert len(png) < 100_000  # it travels in a markdown artifact as base64


def test_the_curve_takes_rows_without_kl_or_eval_and_skips_nan():
    dpo = [{"episode": 0, "reward_mean": 0.3, "dpo_loss": 0.69}, {"episode": 1, "reward_mean": float("nan")}]
    assert png_size(curves_png(dpo)) == (WIDTH, HEIGHT)
    assert png_size(curves_png([])) == (WIDTH, HEIGHT)  # before any episode: axes only


def test_curves_png_is_rewritten_each_episode(tmp_path):
    path = tmp_path / "curves.png"
    first = write_curves(ppo_rows(1), path)
    assert path.read_bytes() == first
    second = write_curves(ppo_rows(2), path)
    assert path.read_bytes() == second != first
    assert png_size(second) == (WIDTH, HEIGHT)
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]  # no temporary file left


def test_the_table_is_json_without_nan():
    rows = table_rows([{"episode": 1, "reward_mean": float("nan"), "kl_mean": float("inf"), "extra": 1}])
    assert rows[0]["episode"] == 1 and "extra" not in rows[0]
    safe = json_safe(rows)
    assert safe[0]["reward_mean"] is None and safe[0]["kl_mean"] is None
    json.loads(json.dumps(safe, allow_nan=False))


def test_stage_names_of_model_calls():
    assert stage_of("generate", {}) == "generate" and stage_of("generate", {"is_eval": True}) == "eval"
    assert stage_of("forward", {"iteration": 3}) == "score" and stage_of("forward", {"is_eval": True}) == "eval"
    assert stage_of("train", {}) == "train" and stage_of("save_checkpoint", {}) == "checkpoint"
    assert stage_of("set_weights", {}) == "sync" and stage_of("ping", {}) is None
    assert trace_name({"policy": (0, 0), "reference": (0, 0)}) == "policy+reference-rank0"
    assert trace_name({"policy": (1, 1), "value": (0, 1)}) == "value-rank1"
    assert trace_name({"policy": (1, 0)}) is None  # ChatLearn profiles replica 0 only


def test_nvtx_ranges_need_a_cuda_build_and_never_fail_without_one():
    assert nvtx_works() == (torch.version.cuda is not None)
    with nvtx_range("episode 1/train/ppo_policy"):  # a no-op on a CPU build, a real range on a CUDA one
        pass


def test_a_worker_profiles_an_episode_into_a_chrome_trace(tmp_path):
    marks = StageMarks(nsys=True, ranks={"ppo_policy": (0, 0)})
    state = marks.begin(2, str(tmp_path / "prof"))
    assert state["profiling"] and state["nvtx"] == nvtx_works()
    with marks.stage("ppo_policy", "train", {}):
        torch.randn(64, 64) @ torch.randn(64, 64)
    with marks.stage("ppo_policy", "ping", {}):  # not an episode's work: no label
        pass
    [path] = marks.end()
    assert path == str(tmp_path / "prof" / "ppo_policy-rank0-episode3.json")
    names = {e.get("name") for e in json.loads(open(path).read())["traceEvents"]}
    assert "episode 3/train/ppo_policy" in names and "aten::mm" in names
    assert not any("ping" in str(n) for n in names)
    assert marks.end() == []  # stopped once
    # a process with no replica 0 rank writes nothing
    other = StageMarks(nsys=False, ranks={"policy": (1, 0)})
    assert not other.begin(0, str(tmp_path / "prof"))["profiling"] and other.end() == []


# -- one real run ------------------------------------------------------------------------------------------


def artifacts_with_key(key):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    return asyncio.run(read())


@pytest.mark.integration
def test_a_two_episode_run_shows_curves_one_table_and_profiles(prefect_api, ray_session, tiny_model_dir, tmp_path,
                                                              monkeypatch, capsys, mlflow_server):
    """PPO, the value/reference/reward/policy colocated in one process and the two trainers alone, 2 episodes
    with eval after the second and before training, profiler and nsys on, and all three experiment trackers."""
    from flows import train_flow
    from tests.test_engine_runs import rows_of, small
    from tests.test_trackers import mlflow_run, tensorboard_scalars, wandb_history

    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)  # value / ppo_value: tiny_llama.yaml's path
    monkeypatch.setenv("WANDB_MODE", "offline")
    prof = tmp_path / "prof"
    logs = "runtime.log_args_dict"
    cfg = small("default", tmp_path, tiny_model_dir, "runtime.exp_name=run-display",
                "runtime.colocation=['policy,reference,reward,value']", f"runtime.profiler_dir={prof}",
                "runtime.nsys=true", f"{logs}.enable_tensorboard=true", f"{logs}.enable_wandb=true",
                f"{logs}.enable_mlflow=true", f"{logs}.mlflow_tracking_uri={mlflow_server}")
    train_flow(cfg)
    run_dir = tmp_path / "run-display"
    rows = rows_of(run_dir)
    assert [r["episode"] for r in rows] == [1, 2] and "eval_reward_mean" in rows[1] and "kl_mean" in rows[1]

    # every metric of every episode in each tracker, the episode (from 1) as the step
    tb = tensorboard_scalars(run_dir / "tensorboard")
    _, config, history = wandb_history(run_dir / "wandb")
    state = json.loads((run_dir / "trackers.json").read_text())
    client, mlrun = mlflow_run(mlflow_server, state["mlflow_run_id"])
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["runtime.exp_name"] == "run-display"
    assert config["runtime"]["exp_name"] == "run-display"
    for key in ("reward_mean", "kl_mean", "policy_loss", "value_loss", "episode_seconds", "stage_seconds/train"):
        values = [r[key] if "/" not in key else r["stage_seconds"]["train"] for r in rows]
        assert tb[key] == [(1, pytest.approx(values[0])), (2, pytest.approx(values[1]))], key
        assert [h[key] for h in history] == pytest.approx(values), key
        assert sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, key)) == [
            (1, pytest.approx(values[0])), (2, pytest.approx(values[1]))], key
    assert [s for s, _ in tb["eval_reward_mean"]] == [2] and [h["_step"] for h in history] == [1, 2]

    # curves.png: the last episode's curve, the same PNG the curve artifact embeds
    png = (run_dir / "curves.png").read_bytes()
    assert png_size(png) == (WIDTH, HEIGHT)
    [curve] = artifacts_with_key("run-display-curves")
    assert curve.type == "markdown" and curve.flow_run_id is not None
    prefix = "![curves](data:image/png;base64,"
    assert curve.data.startswith(prefix)
    assert base64.b64decode(curve.data[len(prefix):].split(")", 1)[0]) == png

    # one metrics table, one version, updated to both episodes, in the same (train) flow run
    # the train flow run is named after its exp_name and start time
    from prefect import get_client

    async def flow_run_name(flow_run_id):
        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).name

    assert re.fullmatch(r"run-display-\d{8}-\d{6}", asyncio.run(flow_run_name(curve.flow_run_id)))

    [table] = artifacts_with_key("run-display-metrics")
    assert table.type == "table" and table.flow_run_id == curve.flow_run_id
    data = json.loads(table.data)
    assert [r["episode"] for r in data] == [1, 2]  # counted from 1 in the UI, as on the terminal
    assert data[1]["reward_mean"] == pytest.approx(rows[1]["reward_mean"])
    assert all(r["kl_mean"] is None or math.isfinite(r["kl_mean"]) for r in data)
    assert "2 episodes" in table.description

    # profiler traces of episode 1: the colocated process once, each trainer in its own
    traces = sorted(p.name for p in prof.iterdir())
    assert traces == ["policy+reference+reward+value-rank0-episode1.json", "ppo_policy-rank0-episode1.json",
                      "ppo_value-rank0-episode1.json"]
    labels = {}
    for name in traces:
        trace = json.loads((prof / name).read_text())
        labels[name] = {e.get("name") for e in trace["traceEvents"]}
    assert {"episode 1/generate/policy", "episode 1/score/reference", "episode 1/score/value",
            "episode 1/score/reward"} <= labels[traces[0]]
    assert "episode 1/train/ppo_policy" in labels["ppo_policy-rank0-episode1.json"]
    assert "episode 1/train/ppo_value" in labels["ppo_value-rank0-episode1.json"]
    assert not any("episode 2/" in str(n) for names in labels.values() for n in names)  # one episode only

    # nsys: on a CPU build of torch the run says once that the ranges need CUDA
    err = capsys.readouterr().err
    needs_cuda = [line for line in err.splitlines() if "NVTX ranges need a CUDA build" in line]
    assert len(needs_cuda) == (0 if nvtx_works() else 1)
    assert "torch profiler traces of episode 1" in err
    assert f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}" in err
    assert f"mlflow: {mlflow_server}/#/experiments/" in err
    assert "wandb: " in err and not [line for line in err.splitlines() if line.startswith("wandb: ") and
                                     "offline: wandb sync" not in line]  # wandb's own chatter stays off


# -- the terminal ------------------------------------------------------------------------------------------


def test_info_lines_stay_off_the_terminal_unless_verbose_and_go_to_the_log(tmp_path, monkeypatch, request):
    from prefect.logging.configuration import ensure_logging_setup

    from chatlearn.runtime.records.console import run_log

    ensure_logging_setup()  # as run_log does first: set up later, it would replace the handler below
    monkeypatch.setenv("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    prefect_logger = logging.getLogger("prefect")
    level = prefect_logger.level
    prefect_logger.setLevel(logging.INFO)  # the suite runs at PREFECT_LOGGING_LEVEL=WARNING
    request.addfinalizer(lambda: prefect_logger.setLevel(level))

    def shown(verbose):
        import io

        stream = io.StringIO()
        console = logging.StreamHandler(stream)
        root = logging.getLogger()
        root.addHandler(console)
        try:
            with run_log(tmp_path / f"run-{verbose}", verbose=verbose) as path:
                logging.getLogger("prefect.task_runs").info("Finished in state Completed()")
                logging.getLogger("prefect.flow_runs").warning("a flow run warning")
                logging.getLogger("chatlearn").warning("our own line")
                logging.getLogger("chatlearn").info("param sync a->b: an in-process copy")
        finally:
            root.removeHandler(console)
        return stream.getvalue().splitlines(), path.read_text()

    ours = logging.getLogger("chatlearn").level
    lines, log = shown(False)
    assert lines == ["a flow run warning", "our own line"]
    assert "prefect.task_runs - Finished in state Completed()" in log  # the log file keeps everything
    # ours too: our INFO lines (launch's routes, its start-up seconds) pass our logger, which the root's WARNING
    # would stop
    assert "chatlearn - param sync a->b: an in-process copy" in log
    assert logging.getLogger("chatlearn").level == ours  # for the run's own duration only
    assert shown(True)[0] == ["Finished in state Completed()", "a flow run warning", "our own line",
                              "param sync a->b: an in-process copy"]


def test_without_a_terminal_each_episode_is_one_line_and_the_run_ends_with_a_summary(tmp_path, capsys):
    from chatlearn.config import load_config
    from chatlearn.runtime.records.reporting import EpisodeReporter, run_summary, summary_text

    cfg = load_config(None, ["runtime.num_episode=3", "runtime.log_interval=2"])
    reporter = EpisodeReporter(cfg, tmp_path)
    assert not reporter.tty  # pytest's stderr is no terminal
    for row in ppo_rows(3):
        reporter.record({**row, "episode_seconds": 2.0, "stage_seconds": {"train": 1.5}})
    reporter.close()
    out, err = capsys.readouterr()
    assert err == ""  # no bar
    assert out.splitlines() == [
        "[episode 1/3] reward_mean=0 episode_seconds=2",  # the short line in the bar's place
        "[episode 2/3] reward_mean=0.1 eval_reward_mean=0.2 kl_mean=0.01 policy_loss=0.5 episode_seconds=2 | "
        "train=1.50s",
        "[episode 3/3] reward_mean=0.2 episode_seconds=2"]
    result = {"final_policy": "/r/final/policy",
              **run_summary(reporter.rows, 3, tmp_path, {"tensorboard": "tensorboard --logdir /r/tb"}, "http://ui/x")}
    assert summary_text(result).splitlines() == [
        "run summary",
        "  episodes          3 of 3 (6.0 s of episodes)",
        "  reward_mean       0.2 (episode 3)",
        "  eval_reward_mean  0.2 (episode 2)",
        "  kl_mean           0.02 (episode 3)",
        "  policy_loss       0.5 (episode 3)",
        f"  run directory     {tmp_path}",
        "  final policy      /r/final/policy",
        "  Prefect UI        http://ui/x",
        "  tensorboard       tensorboard --logdir /r/tb"]
