"""Integration: two episodes of the embedded default through a real Ray and a real Prefect API."""

import json
import os
import time
from datetime import UTC, datetime

import pytest
import torch

from tests.conftest import REPO
from tests.custom_flow_example import documented_engine
from tests.hooked_reward import HookedReward

pytestmark = pytest.mark.integration


def rewards_in_process(cfg, evaluation=False):
    """Episode 0's rewards (or the eval set's, before training) computed here, without Ray or Prefect: the same
    prompts in the same generation batches, sampled by the policy module with the run's seed and sample ids
    (or decoded greedily for eval), scored by the reward rule. Returns (scores, exact-match flags)."""
    from chatlearn.data.records import load_records
    from chatlearn.data.sampler import episode_prompt_batches, eval_prompt_batches
    from chatlearn.models.hf.policy import PolicyInference
    from chatlearn.models.hf.reward import RuleReward
    from chatlearn.tasks.max_digit import exact_match

    rt = cfg.runtime
    policy, reward = PolicyInference("policy"), RuleReward("reward")
    policy.bind(cfg.models["policy"], rt, 0, rt.seed)
    reward.bind(cfg.models["reward"], rt, 0, rt.seed)
    policy.setup()
    reward.setup()
    batch_size = cfg.models["policy"].generation_batch_size
    if evaluation:
        dataset = policy.build_dataset(load_records(rt.eval_data_path))
        batches = eval_prompt_batches(len(dataset), batch_size, 1)
    else:
        dataset = policy.build_dataset(load_records(rt.data_path))
        batches = episode_prompt_batches(len(dataset), 0, rt.sample_per_episode, batch_size, 1, rt.shuffle_seed)
    scores, exact, position = [], [], 0
    for iteration, (_, idx) in enumerate(batches):
        batch = policy.collate_fn([dataset[i] for i in idx])
        if evaluation:
            out = policy.eval_step(batch)
        else:
            batch["sample_id"] = list(range(position, position + len(idx)))
            out = policy.forward_step(batch, iteration)
        position += len(idx)
        scores += reward.score(out).tolist()
        exact += [exact_match({"response": r, "answer": a}) for r, a in zip(out["response"], out["answer"])]
    return scores, exact


def test_two_episodes_of_the_default(prefect_api, ray_session, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The embedded default as a YAML path, shortened to 2 episodes through its ${num_episode:20} variable;
    then the eval flow on the policy it exported."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
        FlowRunFilterStartTime,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatlearn.config import EngineChecks, load_config, root
    from flows import eval_flow, train_flow

    monkeypatch.chdir(tmp_path)  # prompt paths must resolve next to the config, from any directory
    monkeypatch.setenv("num_episode", "2")
    monkeypatch.setenv("CHATLEARN_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    # the config is validated once for the whole run: its own checks and the engine's
    calls = {"config": 0, "engine": 0}
    sections, engine_call = root.check_sections, EngineChecks.__call__

    def count(kind, fn):
        def counted(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(root, "check_sections", count("config", sections))
    monkeypatch.setattr(EngineChecks, "__call__", count("engine", engine_call))
    started = datetime.now(UTC)  # the session's Prefect API holds other tests' episode runs too
    # an alert that holds from the start: it fires once, after episode 2
    result = train_flow(os.path.join(REPO, "configs", "default.yaml"),
                        overrides=["runtime.alerts=['reward_mean > -1 for 2 episodes']"])
    assert calls == {"config": 1, "engine": 1}
    monkeypatch.setattr(root, "check_sections", sections)
    monkeypatch.setattr(EngineChecks, "__call__", engine_call)

    run_dir = tmp_path / "default"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [1, 2]
    cfg = load_config(os.path.join(REPO, "configs", "default.yaml"),
                      [f"runtime.output_dir={tmp_path}", f"models.policy.args_dict.model_path={tiny_model_dir}"])
    first, _ = rewards_in_process(cfg)
    assert len(first) == 128 and len(set(first)) > 1  # a spread of scores, not one value
    assert rows[0]["reward_mean"] == pytest.approx(sum(first) / len(first), abs=1e-6)
    before, _ = rewards_in_process(cfg, evaluation=True)
    assert len(before) == 128
    assert rows[0]["eval_reward_mean_before_training"] == pytest.approx(sum(before) / len(before), abs=1e-6)
    for r in rows:
        assert r["episode_seconds"] > 0
        assert r["train_steps"] == 4  # 128 samples / global batch 32
        assert 1 <= r["response_length_mean"] <= 2  # max_new_tokens
        assert set(r["stage_seconds"]) >= {"generate", "score", "train", "sync", "checkpoint"}
    # every sample of each episode is in its trace table (runtime.trace_samples: all), as its row's means say
    from chatlearn.runtime.records.traces import read_traces

    traces = read_traces(run_dir)
    assert list(traces.groupby("episode").size()) == [128, 128] and traces["trained"].all()
    for r in rows:
        t = traces[traces["episode"] == r["episode"]]
        assert sorted(t["sample_id"]) == list(range((r["episode"] - 1) * 128, r["episode"] * 128))
        assert t["reward"].mean() == pytest.approx(r["reward_mean"], abs=1e-6)
        assert t["kl"].mean() == pytest.approx(r["kl_mean"], abs=1e-6)
        assert t["response_tokens"].mean() == pytest.approx(r["response_length_mean"])
        assert r["trace_bytes"] == (run_dir / "traces" / f"episode_{r['episode']:06d}.parquet").stat().st_size
        # generated on the weights the episode before trained (version = episodes trained), none stale
        assert set(t["policy_version"]) == {r["episode"] - 1} and set(t["staleness"]) == {0}
    assert traces["advantage"].notna().all() and (traces["logprob_mean"] < 0).all()
    assert traces["prompt"].str.len().gt(0).all() and traces["response"].notna().all()
    # eval every 2 episodes: after episode 1 only, plus the baseline before training
    assert "eval_reward_mean" not in rows[0] and "eval_reward_mean" in rows[1]
    assert "eval" in rows[1]["stage_seconds"]
    assert rows[1]["consumed_samples"] == 256
    assert rows[1]["iteration"] == 8
    # save_episode_interval is 10: only the last episode checkpoints (a finished run can be continued)
    assert rows[0]["checkpoint_paths"] == {}
    assert sorted(rows[1]["checkpoint_paths"]) == ["ppo_policy", "ppo_value"]
    assert all(p.endswith("iter_0000008") for p in rows[1]["checkpoint_paths"].values())

    # the final policy is a loadable Hugging Face model, trained away from its init
    final = run_dir / "final" / "policy"
    assert result["final_policy"] == str(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tok("max 1 2 ?").input_ids[0] == tok.bos_token_id
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, init.state_dict()[n])]
    assert len(changed) > 0

    # Prefect saw one subflow per episode, and the artifacts exist
    import asyncio

    async def episode_runs():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=["episode-1", "episode-2"]),
                start_time=FlowRunFilterStartTime(after_=started)))
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
                any_=[r.id for r in runs])), limit=200)
            # by key: the session's API holds every test's artifacts, more than one page
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                any_=["default-progress", "default-metrics", "default-eval-examples", "default-samples"])))
            return runs, tasks, arts

    # the server writes task runs in batches (flushed every second): read until the rule reward's are all there
    # and every parent a task run names is there too (a stage's run can land after the calls under it)
    deadline = time.monotonic() + 30
    while True:
        runs, tasks, arts = asyncio.run(episode_runs())
        ids = {t.id for t in tasks}
        rule = [t for t in tasks if t.name.startswith("rule-reward-")]
        parents = {p.id for t in tasks for p in t.task_inputs.get("__parents__", [])}
        if (len(rule) >= 6 and parents <= ids) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {r.name for r in runs} >= {"episode-1", "episode-2"}  # counted from 1, as the terminal counts
    assert all(r.state.is_completed() for r in runs if r.name in ("episode-1", "episode-2"))
    # the rule reward scores each generation batch in a Prefect task run of its own (on Ray), under the
    # stage's task run: 128 samples / generation batch 64 = 2 per episode, and 2 more for episode 2's eval
    by_id = {t.id: t for t in tasks}

    def parent(t):
        return by_id[t.task_inputs["__parents__"][0].id].name.rsplit("-", 1)[0]

    rule = [t for t in tasks if t.name.startswith("rule-reward-")]
    assert all(t.state.is_completed() for t in rule)
    assert sorted(parent(t) for t in rule) == ["reward.eval_forward"] * 2 + ["reward.forward_step"] * 4
    # each call of the engine's compute flows is a task run named after the model and method, under the stage
    # that runs it, with the calls it reads as its upstream inputs (the UI's run graph is the flow)
    second = next(r.id for r in runs if r.name == "episode-2")
    call_runs = {t.name: t for t in tasks if t.flow_run_id == second and "." in t.name}
    assert {name: parent(t) for name, t in call_runs.items()} == {
        "policy.forward_step": "generate", "reference.forward_step": "score", "value.forward_step": "score",
        "reward.forward_step": "score", "ppo_policy.train_step": "train", "ppo_value.train_step": "train",
        "policy.eval_forward": "eval", "reward.eval_forward": "eval"}
    reads = {i.id for i in call_runs["reward.forward_step"].task_inputs["upstream"]}
    assert reads == {call_runs["reference.forward_step"].id, call_runs["value.forward_step"].id}
    # reference and value do not read each other: their task runs are running at the same time
    ref, val = call_runs["reference.forward_step"], call_runs["value.forward_step"]
    assert ref.start_time < val.end_time and val.start_time < ref.end_time
    keys = {a.key for a in arts}
    assert {"default-progress", "default-metrics", "default-eval-examples", "default-samples"} <= keys
    # each episode's page: the 3 samples of highest and of lowest advantage, and 3 at random
    shown = [a for a in arts if a.key == "default-samples" and a.flow_run_id == second]
    assert len(shown) == 1 and [r["shown"] for r in json.loads(shown[0].data)] == (
        ["highest advantage"] * 3 + ["lowest advantage"] * 3 + ["at random"] * 3)
    # each episode a Prefect event to automate on, about the run, with its row and its checkpoints
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    def completed():
        with get_client(sync_client=True) as client:
            found = client.read_events(EventFilter(event=EventNameFilter(name=["chatlearn.episode.completed"]),
                                                   resource=EventResourceFilter(id=["chatlearn.run.default"])),
                                       limit=50).events  # the client's default, 100, is over the server's 50
        return sorted((e for e in found if e.resource.get("chatlearn.run-dir") == str(run_dir)),
                      key=lambda e: e.payload["episode"])

    deadline = time.monotonic() + 30
    while len(events := completed()) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [e.payload["episode"] for e in events] == [1, 2]
    assert [e.payload["metrics"] for e in events] == rows
    assert events[0].payload["checkpoint"] == {} and events[1].payload["checkpoint"] == rows[1]["checkpoint_paths"]
    train_run = {r.id for e in events for r in e.related if r.role == "flow-run"}  # the train flow run's
    assert [f"prefect.flow-run.{result['summary']['ui'].rsplit('/', 1)[1]}"] == list(train_run)
    assert "chatlearn: alert: reward_mean > -1 for 2 episodes (episodes 1-2: " in capsys.readouterr().err
    deadline = time.monotonic() + 30
    while True:
        with get_client(sync_client=True) as client:
            found = client.read_events(EventFilter(event=EventNameFilter(name=["chatlearn.alert"])), limit=50).events
        # (the session's API holds other tests' alerts, of other run directories or none)
        alerts = [e for e in found if e.resource.get("chatlearn.run-dir") == str(run_dir)]
        if alerts or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(alerts) == 1 and alerts[0].payload["episodes"] == [1, 2]
    assert alerts[0].resource.id == "chatlearn.alert.default.reward-mean-gt--1-for-2"
    roles = {r.role for r in alerts[0].related}  # Prefect adds the flow's own
    assert {"run", "flow-run"} <= roles and "deployment" not in roles  # no deployment started this run
    # the eval hook of the default config adds exact match to the rows (an exact answer scores 1.0)
    assert rows[1]["eval_exact_match"] <= rows[1]["eval_reward_mean"]

    # ChatLearn's EvalEngine on the exported policy scores exactly what the run's last eval scored (the
    # inference copy synced after episode 2 is that policy), and writes eval.json
    metrics = eval_flow(load_config(os.path.join(REPO, "configs", "default.yaml"), [
        f"runtime.output_dir={tmp_path}", "runtime.exp_name=evalonly", f"models.policy.args_dict.model_path={final}"]))
    assert metrics["eval_reward_mean"] == rows[1]["eval_reward_mean"]
    assert metrics["eval_exact_match"] == rows[1]["eval_exact_match"]
    assert metrics["eval_num_samples"] == 128 and metrics["model_path"] == str(final)
    assert json.loads((tmp_path / "evalonly" / "eval.json").read_text()) == json.loads(json.dumps(metrics))
    assert live_actor_names("chatlearn-evalonly") == []


def small_config(tmp_path, tiny_model_dir, exp_name, *extra):
    from chatlearn.config import load_config

    return load_config(os.path.join(REPO, "configs", "default.yaml"), [
        "runtime.num_episode=1", "runtime.sample_per_episode=16", "runtime.generation_batch_size=8",
        "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.eval_episode_interval=0",
        f"runtime.output_dir={tmp_path}", f"runtime.exp_name={exp_name}",
        f"models.policy.args_dict.model_path={tiny_model_dir}", *extra,
    ])


def live_actor_names(namespace):
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def test_chatlearns_custom_flow_example_runs_unchanged(prefect_api, ray_session, tiny_model_dir, tmp_path,
                                                       monkeypatch):
    """ChatLearn's documented custom flow (`tests/custom_flow_example.py`, as its docs write it) with our modules
    under its names: one episode and its eval. Its rewards are those the policy and the rule give in-process
    (the simple path)."""
    import chatlearn
    from chatlearn.config import EngineChecks
    from chatlearn.data.records import load_records
    from chatlearn.models.hf.policy import PolicyInference
    from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer as PolicyTrainer
    from chatlearn.models.hf.ppo_trainer import PPOValueTrainer as ValueTrainer
    from chatlearn.models.hf.reference import ReferenceModel as PolicyReference
    from chatlearn.models.hf.value import ValueModel as ValueInference

    RewardInference = HookedReward  # noqa: N806  # the example's class name for a reward module
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    # no advantage estimator named: the reward runs the one its trainer (PPO's) trains on, GAE
    cfg = chatlearn.init(small_config(tmp_path, tiny_model_dir, "engine", "runtime.save_episode_interval=1",
                                      "runtime.eval_episode_interval=1", "runtime.enable_eval_before_training=false"))
    train_prompts, val_prompts = load_records(cfg.runtime.data_path), load_records(cfg.runtime.eval_data_path)

    engine = documented_engine(PolicyInference, ValueInference, PolicyReference, RewardInference, PolicyTrainer,
                               ValueTrainer, train_prompts, val_prompts)
    import chatlearn.runtime.prepared as prepared

    runs, reads = [], []
    checks, preflight = EngineChecks.__call__, prepared.preflight
    monkeypatch.setattr(EngineChecks, "__call__", lambda self, cfg: runs.append(self.modules) or checks(self, cfg))
    monkeypatch.setattr(prepared, "preflight", lambda cfg, eng: reads.append(eng.name) or preflight(cfg, eng))
    result = engine.learn()
    # learn() prepares the run once (checks with these modules, data read); the flow's call and body take it
    assert len(runs) == 1 and type(runs[0]["ppo_policy"]) is PolicyTrainer
    assert reads == ["engine"]
    assert result["episode"] == 1 and result["train_steps"] == 1
    # the records given in code were generated on and scored as the policy and the rule do in-process
    first, _ = rewards_in_process(cfg)
    assert result["reward_mean"] == pytest.approx(sum(first) / len(first), abs=1e-6)
    assert 0 <= result["eval_reward_mean"] <= 1
    # ChatLearn's episode hooks ran around the one episode
    assert (tmp_path / "engine" / "hooks.log").read_text().split() == ["before", "after"]
    rows = (tmp_path / "engine" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1
    # save_episode_interval=1: both trainers saved at trainer iteration 1
    paths = json.loads(rows[0])["checkpoint_paths"]
    assert set(paths) == {"ppo_policy", "ppo_value"}
    assert paths["ppo_policy"].endswith(os.path.join("checkpoints", "ppo_policy", "iter_0000001"))
    assert os.path.exists(os.path.join(paths["ppo_value"], "model.safetensors"))
    assert live_actor_names("chatlearn-engine") == []


def test_a_failing_episode_fails_the_run_and_kills_the_actors(prefect_api, ray_session, tiny_model_dir, tmp_path,
                                                              monkeypatch):
    from flows import train_flow

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    # math.sqrt(sample_dict) raises TypeError inside the reward actor during the score task
    cfg = small_config(tmp_path, tiny_model_dir, "boom", "models.reward.args_dict.reward_fn=math:sqrt")
    with pytest.raises(Exception, match="must be real number|TypeError"):
        train_flow(cfg)
    assert live_actor_names("chatlearn-boom") == []
    assert not (tmp_path / "boom" / "final").exists()


def test_bad_config_is_rejected_before_a_flow_run_exists(prefect_api):
    import asyncio

    from prefect import get_client

    from chatlearn.utils.arguments import ConfigError
    from flows import train_flow

    async def count_runs():
        async with get_client() as client:
            return len(await client.read_flow_runs())

    before = asyncio.run(count_runs())
    bad = {"runtime": {"train_global_batch_size": 3},
           "models": {"policy": {"num_cpu": 1, "args_dict": {"max_new_tokens": 0}}}}
    with pytest.raises(ConfigError) as err:
        train_flow(bad)
    assert any(p.startswith("runtime.train_global_batch_size") for p in err.value.problems)
    assert any(p.startswith("models.policy.args_dict.max_new_tokens") for p in err.value.problems)
    assert asyncio.run(count_runs()) == before
