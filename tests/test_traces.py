"""Per-sample traces (issue 47, item 1): an episode's samples as rows of plain values, written whole or not at all
beside its metrics row, cut on resume as the rows are, and read back by `chatlearn trace`. Whole runs write
them too: tests/test_train_flow.py (the default's two episodes) and tests/test_resume.py (a SIGKILLed run's
tables equal the uninterrupted run's)."""

import json

import pandas as pd
import pytest
import torch

from chatlearn.cli import main
from chatlearn.runtime.records.traces import drop_traces_after, read_traces, trace_path, trace_rows, write_trace


def sample(i: int, score: float, version: int | None = None, **extra) -> dict:
    s = {"sample_id": i, "group_id": i // 2, "prompt": f"max {i} ?", "response": f"{i % 10}",
         "prompt_mask": torch.tensor([0, 1, 1]), "response_mask": torch.tensor([1.0, 1.0, 0.0]),
         "scores": torch.tensor(score), "rewards/answer": score, "rewards/format": 0.5,
         "advantages": torch.tensor([1.0, 3.0, 100.0]) * (i + 1),  # the padded third token is not counted
         "logprobs": torch.tensor([-1.0, -2.0, -50.0]), "kl": torch.tensor([0.25, 0.25, 0.0])}
    if version is not None:
        s["policy_version"] = version
    s.update(extra)
    return s


def test_rows_hold_each_samples_values_over_its_response_tokens():
    samples = [sample(0, 1.0, version=3, turns=2), sample(1, 0.0, version=2, turns=3)]
    rows = trace_rows(samples, trained=[0], episode=3, keep="all", seed=42)
    assert rows[0] == {
        "episode": 4, "sample_id": 0, "group_id": 0, "prompt": "max 0 ?", "response": "0", "prompt_tokens": 2,
        "response_tokens": 2, "reward": 1.0, "rewards/answer": 1.0, "rewards/format": 0.5, "advantage": 2.0,
        "return": None, "kl": 0.5, "policy_version": 3, "staleness": 0, "logprob_mean": -1.5,
        "trainer_logprob_mean": None, "turns": 2.0, "trained": True}
    assert (rows[1]["advantage"], rows[1]["policy_version"], rows[1]["staleness"], rows[1]["trained"]) == (
        4.0, 2, 1, False)
    # no version stamp (one stage after another): the weights the episode generated on, version `episode`
    assert trace_rows([sample(0, 1.0)], [0], episode=5, keep="all", seed=0)[0]["policy_version"] == 5
    assert trace_rows(samples, [0], 3, keep="none", seed=42) == []


def test_a_number_keeps_that_many_the_same_for_the_same_seed_and_episode():
    samples = [sample(i, float(i % 2)) for i in range(20)]
    ids = [[r["sample_id"] for r in trace_rows(samples, [], episode, keep=5, seed=seed)]
           for episode, seed in ((1, 42), (1, 42), (2, 42), (1, 7))]
    assert all(len(x) == 5 and x == sorted(x) for x in ids)
    assert ids[0] == ids[1] and ids[0] != ids[2] and ids[0] != ids[3]
    assert len(trace_rows(samples, [], 1, keep=50, seed=42)) == 20


def test_a_table_is_written_whole_and_a_resume_cuts_the_episodes_that_run_again(tmp_path):
    for episode in range(3):
        rows = trace_rows([sample(i, 1.0) for i in range(4)], range(4), episode, "all", 0)
        assert write_trace(tmp_path, episode, rows) == trace_path(tmp_path, episode).stat().st_size > 0
    assert write_trace(tmp_path, 3, []) == 0 and not trace_path(tmp_path, 3).exists()
    table = read_traces(tmp_path)
    assert list(table["episode"]) == [1] * 4 + [2] * 4 + [3] * 4
    assert list(read_traces(tmp_path, episode=2)["sample_id"]) == [0, 1, 2, 3]
    half = trace_path(tmp_path, 3).with_suffix(".parquet.tmp")
    half.write_bytes(b"PAR1 cut short")  # a SIGKILL while it was written
    drop_traces_after(tmp_path, 1)  # resuming after episode 1: episodes 2 and 3 run again
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["episode_000001.parquet"]
    assert list(read_traces(tmp_path)["episode"]) == [1] * 4


def test_chatlearn_trace_prints_filters_and_writes_the_rows(tmp_path, capsys):
    run = tmp_path / "run"
    for episode in range(2):
        write_trace(run, episode, trace_rows([sample(i, float(i % 2)) for i in range(6)], range(6), episode, "all",
                                             0))
    assert main(["trace", str(run), "--episode", "2", "--where", "reward > 0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["episode", "sample_id", "group_id", "reward", "advantage", "policy_version",
                                "staleness", "prompt", "response"]
    assert [line.split()[:4] for line in lines[1:]] == [["2", str(i), str(i // 2), "1.0"] for i in (1, 3, 5)]
    out = tmp_path / "high.jsonl"
    assert main(["trace", str(run), "--where", "advantage >= 8", "--columns", "episode,sample_id,advantage",
                 "--out", str(out)]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"episode": e, "sample_id": i, "advantage": 2.0 * (i + 1)} for e in (1, 2) for i in (3, 4, 5)]
    # which responses got the highest advantage in episode 2, and which weights generated them
    assert main(["trace", str(run), "--episode", "2", "--sort", "advantage", "--reverse", "--limit", "2",
                 "--columns", "sample_id,advantage,policy_version,response"]) == 0
    assert [line.split() for line in capsys.readouterr().out.splitlines()] == [
        ["sample_id", "advantage", "policy_version", "response"], ["5", "12.0", "1", "5"], ["4", "10.0", "1", "4"]]
    assert main(["trace", str(run), "--limit", "3"]) == 0
    shown = capsys.readouterr()
    assert len(shown.out.splitlines()) == 4 and "(12 samples; the first 3 shown" in shown.err
    pd.testing.assert_frame_equal(read_traces(run), pd.concat([pd.read_parquet(trace_path(run, e)) for e in (0, 1)],
                                                              ignore_index=True))


@pytest.mark.parametrize("args, said", [
    (["--where", "rewad > 1"], "--where 'rewad > 1': UndefinedVariableError"),
    (["--columns", "reward,nope"], "--columns: no column nope (columns: episode, sample_id,"),
    (["--episode", "9"], "keeps no samples of episode 9 (its traces/ folder: runtime.trace_samples)"),
    (["--out", "x.txt"], "--out x.txt: .parquet, .csv or .jsonl"),
    (["--sort", "advantag"], "--sort: no column advantag (columns: episode,"),
])
def test_what_chatlearn_trace_cannot_do_is_one_line(tmp_path, capsys, args, said):
    write_trace(tmp_path, 0, trace_rows([sample(0, 1.0)], [0], 0, "all", 0))
    assert main(["trace", str(tmp_path), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("chatlearn: error: ") and said in err and len(err.strip().splitlines()) == 1, err


def test_an_episodes_page_shows_the_samples_of_highest_and_lowest_advantage_and_a_few_at_random():
    from chatlearn.runtime.records.traces import explaining

    rows = trace_rows([sample(i, float(i % 2), response="x" * 300) for i in range(10)], range(10), 0, "all", 0)
    shown = explaining(rows, seed=42)
    assert [(r["shown"], r["sample_id"]) for r in shown[:6]] == [
        ("highest advantage", 9), ("highest advantage", 8), ("highest advantage", 7),
        ("lowest advantage", 2), ("lowest advantage", 1), ("lowest advantage", 0)]
    rest = [r["sample_id"] for r in shown[6:]]
    assert len(rest) == 3 and set(rest) <= {3, 4, 5, 6} and rest == [r["sample_id"] for r in explaining(rows, 42)[6:]]
    assert shown[0]["response"] == "x" * 200 + "..." and shown[0]["advantage"] == 20.0
    assert list(shown[0]) == ["shown", "sample_id", "reward", "advantage", "policy_version", "staleness", "prompt",
                              "response"]
    assert len(explaining(rows[:4], seed=42)) == 4  # fewer samples than it would show: each once


def test_a_stall_is_said_once_for_an_episode_past_its_factor_times_the_median():
    from chatlearn.runtime.records.events import StallWatch

    now = [0.0]
    said = []
    watch = StallWatch(3.0, lambda *a: said.append(a), first=0, clock=lambda: now[0])
    watch.close()  # checked by hand below, not from its thread
    for episode, seconds in enumerate([10.0, 30.0, 20.0]):
        now[0] += 100.0  # long, but three episodes are needed before any median counts
        watch.check()
        watch.episode_done(episode, seconds)
    now[0] += 60.0  # episode 3 (0-based) so far: 3 x the median (20 s), not more
    watch.check()
    assert said == []
    now[0] += 1.0
    watch.check()
    watch.check()
    assert said == [(3, 61.0, 20.0)]  # once for the episode
    watch.episode_done(3, 61.0)
    now[0] += 200.0
    watch.check()
    assert said[-1] == (4, 200.0, 25.0)
    off = StallWatch(0.0, lambda *a: said.append(a), first=0, clock=lambda: now[0])
    for episode in range(3):
        off.episode_done(episode, 1.0)
    now[0] += 1e6
    off.check()
    off.close()
    assert len(said) == 2


@pytest.mark.integration
def test_a_stalled_run_is_an_event_on_the_api(prefect_api, tmp_path):
    import time
    import uuid

    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from chatlearn.runtime.records.events import STALLED, emit, run_resource

    exp = f"stall-{uuid.uuid4().hex[:8]}"
    emit(STALLED, run_resource(exp, str(tmp_path)), {"episode": 7, "seconds": 61.0, "median_seconds": 20.0,
                                                     "stall_factor": 3.0}, None)
    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:  # events are written by the server's own consumer, in batches
            found = client.read_events(EventFilter(event=EventNameFilter(name=[STALLED]), resource=EventResourceFilter(
                id=[f"chatlearn.run.{exp}"])), limit=50).events  # the client's default, 100, is over the server's 50
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert len(found) == 1 and found[0].payload["episode"] == 7
    assert found[0].resource["chatlearn.run-dir"] == str(tmp_path)


def test_an_alert_fires_once_per_streak_of_rows_that_meet_it_and_a_resume_counts_on():
    from chatlearn.config.alerts import Alerts, parse_alert

    alert = parse_alert(" reward_mean < 0.1 for 3 episodes ")
    assert (alert.metric, alert.op, alert.value, alert.episodes, alert.text) == (
        "reward_mean", "<", 0.1, 3, "reward_mean < 0.1 for 3 episodes")
    assert alert.slug == "reward-mean-lt-0.1-for-3" and parse_alert("eval_reward_mean>=1e-2").episodes == 1
    for bad in ("reward mean < 0.1", "reward_mean ~ 1", "reward_mean < x", "reward_mean < 1 for 0 episodes"):
        with pytest.raises(ValueError, match="is not an alert: METRIC OP NUMBER"):
            parse_alert(bad)
    rewards = [0.5, 0.05, 0.02, None, 0.01, 0.0, 0.3, 0.05, 0.05, 0.05]  # None: a row without the metric
    rows = [{"episode": e + 1, **({"reward_mean": r} if r is not None else {})} for e, r in enumerate(rewards)]
    alerts = Alerts(["reward_mean < 0.1 for 3 episodes", "eval_reward_mean > 0.9"])
    fired = {row["episode"]: [(a.text, eps) for a, eps in alerts.update(row)] for row in rows}
    assert {e: f for e, f in fired.items() if f} == {
        5: [("reward_mean < 0.1 for 3 episodes", [2, 3, 4, 5])],  # episode 4 had no reward_mean: neither way
        10: [("reward_mean < 0.1 for 3 episodes", [8, 9, 10])]}  # once per streak, again after 0.3 broke it
    resumed = Alerts(["reward_mean < 0.1 for 3 episodes"])
    for row in rows[:8]:  # the rows a resumed run keeps, replayed
        resumed.update(row)
    assert [(a.text, eps) for a, eps in resumed.update(rows[8])] == []
    assert [(a.text, eps) for a, eps in resumed.update(rows[9])] == [("reward_mean < 0.1 for 3 episodes", [8, 9, 10])]


@pytest.mark.integration
def test_an_alert_automation_pauses_its_deployment_when_a_run_of_it_emits_the_alert(prefect_api, tmp_path):
    import time
    import uuid

    from prefect import flow, get_client

    from chatlearn.config.alerts import ALERT, parse_alert
    from chatlearn.runtime.records.events import emit
    from flows.deployments import alert_automation

    @flow(name="alerting")
    def alerting() -> None:
        pass

    name = f"alert-{uuid.uuid4().hex[:8]}"
    dep_id = alerting.to_deployment(name=name).apply()
    automation = alert_automation(dep_id, f"alerting/{name}", "reward_mean < 0.1 for 3 episodes")
    assert alert_automation(dep_id, f"alerting/{name}", "reward_mean < 0.1 for 3 episodes").id != automation.id
    with get_client(sync_client=True) as client:  # registered again: replaced, not doubled
        named = f"alerting/{name}: pause when reward_mean < 0.1 for 3 episodes"
        assert len(client.read_automations_by_name(named)) == 1
        alert = parse_alert("reward_mean < 0.1 for 3 episodes")
        # another deployment's run with the same alert: not this deployment's business
        emit(ALERT, {"prefect.resource.id": f"chatlearn.alert.x.{alert.slug}", "chatlearn.alert": alert.text},
             {"alert": alert.text}, [{"prefect.resource.id": f"prefect.deployment.{uuid.uuid4()}",
                                      "prefect.resource.role": "deployment"}])
        time.sleep(3)
        assert not client.read_deployment(dep_id).paused
        emit(ALERT, {"prefect.resource.id": f"chatlearn.alert.x.{alert.slug}", "chatlearn.alert": alert.text},
             {"alert": alert.text}, [{"prefect.resource.id": f"prefect.deployment.{dep_id}",
                                      "prefect.resource.role": "deployment"}])
        deadline = time.monotonic() + 60
        while not client.read_deployment(dep_id).paused and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.read_deployment(dep_id).paused


def test_the_ui_shows_floats_to_four_digits_and_the_table_keeps_them_whole(tmp_path):
    from chatlearn.runtime.records.traces import explaining

    rows = trace_rows([sample(i, 1 / 3) for i in range(2)], range(2), 0, "all", 0)
    assert explaining(rows, seed=0)[0]["reward"] == 0.3333 and rows[0]["reward"] == pytest.approx(1 / 3, abs=1e-7)


def test_a_table_that_cannot_be_written_is_one_error_naming_it_and_leaves_no_half_file(tmp_path, monkeypatch):
    import errno

    import pyarrow.parquet as pq

    from chatlearn.utils.errors import RunError

    def full(table, where):
        open(where, "wb").write(b"PAR1")  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    with pytest.raises(RunError) as err:
        write_trace(tmp_path, 0, trace_rows([sample(0, 1.0)], [0], 0, "all", 0))
    assert str(err.value) == (f"cannot write an episode's samples to {trace_path(tmp_path, 0)}: [Errno 28] No space "
                              "left on device")
    assert list((tmp_path / "traces").iterdir()) == []
