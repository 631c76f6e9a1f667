"""Integration: two episodes of each engine from its shipped config (GRPO, DPO, online DPO with LoRA, DAPO, the
pipelined and the multi-turn GRPO), through a real Ray and a real Prefect API, each resumed exactly after a SIGKILL
of a real process."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.conftest import train_here as run_here

pytestmark = pytest.mark.integration

SMALL = ["runtime.num_episode=2", "runtime.sample_per_episode=32", "runtime.generation_batch_size=16",
         "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.eval_episode_interval=2"]


def small(name, tmp_path, tiny_model_dir, *extra):
    from chatlearn.config import load_config

    path = os.path.join(REPO, "configs", f"{name}.yaml")
    return load_config(path, [*SMALL, f"runtime.output_dir={tmp_path}", f"runtime.exp_name={name}-{len(extra)}",
                              f"models.ppo_policy.args_dict.model_path={tiny_model_dir}",
                              *(f"models.{m}.args_dict.model_path={tiny_model_dir}" for m in ("policy", "reference")
                                if m in _models(path)), *extra])


def _models(path):
    import yaml

    return yaml.safe_load(open(path))["models"]


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_two_episodes_and_the_current_old_logprobs(prefect_api, ray_session, tiny_model_dir, tmp_path):
    from flows import train_flow

    cfg = small("grpo", tmp_path, tiny_model_dir, "runtime.train_global_batch_size=32")
    train_flow(cfg)
    rows = rows_of(tmp_path / cfg.runtime.exp_name)
    assert [r["episode"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train_steps"] == 1 and r["num_samples"] == 32
        assert 0 <= r["clipfrac"] <= 1 and "kl_loss" in r and "policy_loss" in r
    # one step per episode: the first one is on-policy (ratio 1, nothing clipped) at the reference (KL 0)
    assert rows[0]["kl_loss"] == pytest.approx(0.0, abs=1e-5) and rows[0]["clipfrac"] == 0.0
    assert rows[0]["approx_kl"] == pytest.approx(0.0, abs=1e-5)
    assert rows[1]["kl_loss"] > 0
    assert "eval_reward_mean_before_training" in rows[0] and "eval_exact_match" in rows[1]

    # the training forward's own log-probs as the old ones (one step an episode): the same weights give the same
    # first episode (the trainer's own forward pass as the source: tests/test_vllm.py's GRPO runs; the three agree
    # on one batch: tests/test_engines_unit.py)
    cfg2 = small("grpo", tmp_path, tiny_model_dir, "runtime.train_global_batch_size=32", "runtime.num_episode=1",
                 "models.ppo_policy.args_dict.old_logprobs=current", "runtime.eval_episode_interval=0",
                 "runtime.enable_eval_before_training=false", "runtime.exp_name=grpo-current")
    train_flow(cfg2)
    first = rows_of(tmp_path / cfg2.runtime.exp_name)[0]
    assert first["reward_mean"] == rows[0]["reward_mean"]
    for key in ("policy_loss", "clipfrac", "approx_kl", "kl_loss", "policy_grad_norm"):
        assert first[key] == pytest.approx(rows[0][key], abs=1e-5), key
    assert first["approx_kl"] == 0.0 and first["stage_seconds"]["score"] > 0


def assert_lora_checkpoints_and_merged_export(run_dir, final, tiny_model_dir):
    """configs/online_dpo.yaml's LoRA run: its rows, checkpoints of adapters apart from the frozen base (written
    once), and an export merged (plain transformers loads it, no adapter files) that moved away from the base."""
    from transformers import AutoModelForCausalLM

    rows = rows_of(run_dir)
    assert [r["episode"] for r in rows] == [1, 2]
    assert all(r["num_pairs"] > 0 and 0 <= r["pair_accuracy"] <= 1 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["trainable_params"] < summary["total_params"] / 5
    ckpt = run_dir / "checkpoints" / "ppo_policy"
    assert sorted(p.name for p in ckpt.iterdir()) == ["base", "iter_0000002", "iter_0000004"]
    adapters = load_file(str(next((ckpt / "iter_0000004").glob("*.safetensors"))))
    assert adapters and all("lora_" in k for k in adapters)
    assert not os.path.exists(os.path.join(final, "adapter_config.json"))
    model = AutoModelForCausalLM.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, base[k])}
    assert changed and all(any(p in k for p in ("proj",)) for k in changed)


RESUME_ARGS = [*SMALL, "runtime.save_episode_interval=1", "runtime.eval_episode_interval=0",
               "runtime.enable_eval_before_training=false"]
# GRPO resumes through issue 25's paths: continuous batching (6 slots for 16 prompts: slots refill; responses
# up to 12 tokens), and the reference and trainer packed, 48-token micro-batches (the global batch re-cut); and
# issue 26's partial rollouts: two rounds of 6 tokens, the responses in flight checkpointed with episode 1, and
# each response trained as it finishes (mini_response_per_prompt 0): episode 1 trains its one early EOS, a part
# of its group, whose rest trains in episode 2, after the checkpoint (1 of 8 would otherwise wait for it)
RESUME_EXTRA = {"grpo": ["runtime.rollout_engine=continuous", "models.policy.args_dict.max_num_seqs=6",
                         "models.policy.args_dict.max_new_tokens=12", "models.reference.packing=true",
                         "models.ppo_policy.packing=true", "models.ppo_policy.max_token_in_packing=48",
                         "runtime.use_partial_rollout=true", "runtime.stream_data_loader_type=dynamic",
                         "runtime.partial_rollout_manager_config.mini_response_per_prompt=0"],
                # issue 27's dynamic sampling: one-token answers (the overlong penalty the same for all) in groups
                # of 4, so groups all wrong are common: each episode generates a second round of prompts
                "dapo": ["models.policy.args_dict.max_new_tokens=1", "models.reward.args_dict.max_response_length=1",
                         "models.reward.args_dict.overlong_buffer_len=1",
                         "models.policy.args_dict.num_inference_per_prompt=4"],
                # DPO's preference learnt, in its eval after episode 2 (the policy is the reference before training)
                "dpo": ["runtime.sample_per_episode=64", "runtime.eval_episode_interval=2",
                        "runtime.enable_eval_before_training=true"],
                # online DPO with LoRA generates on vLLM: the merged weights pushed into it, a new engine after
                # the kill drawing what the killed run's would have (per-request seeds)
                "online_dpo": ["runtime.rollout_engine=vllm"],
                # three episodes, so a later one generates while the killed one trains; responses of up to 12
                # tokens (the shipped 16, for time), so generation takes long enough for the overlap to show
                "grpo_async": ["runtime.num_episode=3", "models.policy.args_dict.max_new_tokens=12"],
                # the eval's conversations too, after episode 2
                "agent_higher_lower": ["runtime.eval_episode_interval=2"]}


def engine_args(config, exp):
    """The command's arguments for run ``exp`` of ``config`` with the resume tests' settings."""
    return [f"configs/{config}.yaml", *RESUME_ARGS, *RESUME_EXTRA.get(config, []), f"runtime.exp_name={exp}"]


def train_engine(config, out, exp, tiny_model_dir, crash=None, kill=None):
    """A `chatlearn train` process of ``config`` that joins the session's Ray (a local Ray of its own, started and
    ended, costs seconds: its SIGKILL is tests/test_resume.py's), SIGKILLed at ``crash``; ``kill``: a model
    process of it SIGKILLed before (CHATLEARN_KILL_AT)."""
    import ray
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(out), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               PREFECT_API_URL=PREFECT_API_URL.value(), RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    for name, value in (("CHATLEARN_CRASH_AT", crash), ("CHATLEARN_KILL_AT", kill)):
        env.pop(name, None)
        if value:
            env[name] = value
    return subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", *engine_args(config, exp)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


def train_here(config, out, exp, tiny_model_dir, monkeypatch, **variables):
    """The same run as `train_engine` without a crash, in this process on the session's Ray (no process or Ray
    to start): the reference a killed process's runs must reproduce."""
    return run_here(engine_args(config, exp), out, tiny_model_dir, monkeypatch, **variables)


def killed_and_resumed(config, tmp_path, ref, exp, crash, timing, tiny_model_dir, monkeypatch, capsys, kill=None):
    """A `chatlearn train` process of ``config`` SIGKILLed at ``crash`` (``kill``: a model process of it SIGKILLed
    before, recovered in that run), then the same run again here: it resumes after episode 1 and ends with run
    ``ref``'s final policy and rows (less ``timing``), bit for bit. Returns what the re-run wrote to stderr and the
    rows."""
    killed = train_engine(config, tmp_path, exp, tiny_model_dir, crash=crash, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    if kill:
        assert "died during episode 1; recreating the model processes" in killed.stderr, killed.stderr[-3000:]
    capsys.readouterr()
    train_here(config, tmp_path, exp, tiny_model_dir, monkeypatch)
    again = capsys.readouterr().err
    assert "resuming after episode 1 " in again, again[-3000:]
    expected = load_file(str(tmp_path / ref / "final" / "policy" / "model.safetensors"))
    weights = load_file(str(tmp_path / exp / "final" / "policy" / "model.safetensors"))
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)

    def rows(name):
        return [{k: v for k, v in r.items() if k not in timing} for r in rows_of(tmp_path / name)]

    assert rows(exp) == rows(ref)
    return again, rows(ref)


@pytest.mark.parametrize("config", ["grpo", "dpo", "online_dpo", "dapo"])
def test_resume_after_sigkill_is_bit_identical(config, prefect_api, ray_session, tiny_model_dir, tmp_path,
                                               monkeypatch, capsys):
    """A `chatlearn train` process killed while episode 2 trains, then the same run again: the uninterrupted
    run's final policy and rows, bit for bit (GRPO: with continuous batching, packing and partial rollouts; DPO:
    with its evals, the preference learnt; online DPO with LoRA, generating on vLLM: the adapters, the base check,
    the merged export and vLLM's draws resume too; DAPO: with dynamic sampling's extra rounds of prompts). The
    reference and the re-run run here, on the session's Ray (a re-run in a new process of its own:
    tests/test_resume.py); the killed run is a process of its own, SIGKILLed. The reference's rows show what each
    engine's two episodes do."""
    timing = ("episode_seconds", "stage_seconds", "peak_memory_mb", "startup_seconds", "checkpoint_paths",
              "partial_rollouts")
    result = train_here(config, tmp_path, "ref", tiny_model_dir, monkeypatch)
    if config == "grpo":  # partial rollouts: what episode 1 left unfinished, episode 2 continued
        first, second = rows_of(tmp_path / "ref")
        assert first["round_0_samples"] == 32 and first["partial_unfinished"] > 0
        assert second["round_1_samples"] == first["partial_unfinished"]
        assert second["partial_released"] == second["num_samples"] > 0
        assert first["num_samples"] == first["partial_released"] > 0 and first["partial_group_parts"] > 0
        assert second["partial_group_parts"] > 0 and first["partial_waiting"] == second["partial_waiting"] == 0
        # a continued response's first round was drawn on the weights before episode 1's step
        assert second["staleness_max"] == 0.0 and 0 < second["staleness_token_mean"] < 1
    if config == "dapo":  # the groups all scored the same are dropped, the stream's next prompts fill the episode
        first, second = rows_of(tmp_path / "ref")
        assert first["dynamic_sampling_rounds"] == 2 and first["filtered_groups"] > 0
        assert first["consumed_samples"] == 64 and first["num_samples"] == 32
        assert second["consumed_samples"] == 64 + 32 * second["dynamic_sampling_rounds"]
    if config == "dpo":  # the preference learnt: no margin before training (the policy is the reference), then one
        first, second = rows_of(tmp_path / "ref")
        assert second["consumed_samples"] == 128 and first["eval_reward_mean_before_training"] == 0.0
        assert first["dpo_loss"] < 0.6932  # log 2 at the first step, then lower
        assert second["eval_preference_accuracy"] > 0.5 and second["eval_reward_margin"] > 0
        assert os.path.isfile(os.path.join(result["final_policy"], "model.safetensors"))
    if config == "online_dpo":  # LoRA: the checkpoints hold adapters apart from the frozen base, written once
        assert_lora_checkpoints_and_merged_export(tmp_path / "ref", result["final_policy"], tiny_model_dir)
    # online DPO: the killed process's policy process, vLLM's engine in it, SIGKILLed in episode 1 first: the run
    # recreates its model processes and redoes the episode, a new engine drawing what the lost one would have
    kill = "policy:after_generate:0" if config == "online_dpo" else None
    again, rows = killed_and_resumed(config, tmp_path, "ref", "killed", "after_generate:1", timing, tiny_model_dir,
                                     monkeypatch, capsys, kill=kill)
    assert len(rows) == 2
    if config == "grpo":
        assert "old log-probs: generation (the policy holds the trainer's weights" in again


def _exp_name(flow_run) -> str | None:
    """The run an episode's flow run belongs to: its ``ctx`` parameter shows the run's spec
    (`chatlearn.runtime.context.RunContext.as_parameter`)."""
    return flow_run.parameters.get("ctx", {}).get("runtime", {}).get("exp_name")


def _stage_runs(exp, episodes, stages):
    """{(episode name, stage): its stage task run} of run ``exp``, once the API has them all (task runs are
    written in batches)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:
            runs = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=episodes))) if _exp_name(r) == exp]
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs])))
            assert sorted(r.name for r in runs) == sorted(episodes), "one flow run per episode of this run"
            name = {r.id: r.name for r in runs}
            found = {(name[t.flow_run_id], t.name.rsplit("-", 1)[0]): t for t in tasks
                     if t.name.rsplit("-", 1)[0] in stages and t.end_time is not None}
            if len(found) == len(episodes) * len(stages) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def test_pipelined_grpo_overlaps_its_episodes_and_resumes_bit_identical(prefect_api, ray_session, tiny_model_dir,
                                                                        tmp_path, monkeypatch, capsys):
    """configs/grpo_async.yaml (runtime.max_staleness 1) for three episodes: episode N+1 generates on the weights
    of episode N-1 while episode N scores and trains, each in its own episode subflow, and the API's task runs
    show the overlap; every sample is one version old from the second episode on (stamped at generation, counted
    at training). A `chatlearn train` process SIGKILLed while episode 2 trains and episode 3 generates, then the
    same run again: the uninterrupted run's final policy and rows, bit for bit; and so does a run whose policy
    process is SIGKILLed there (recovered in the run)."""
    # exp names of their own: the session's API also holds the other tests' runs named ref, episode-2, ...
    timing = ("episode_seconds", "stage_seconds", "peak_memory_mb", "startup_seconds", "checkpoint_paths",
              "policy_versions")
    train_here("grpo_async", tmp_path, "async-ref", tiny_model_dir, monkeypatch)
    ref = rows_of(tmp_path / "async-ref")
    assert [(r["staleness_mean"], r["staleness_max"], r["dropped_stale"]) for r in ref] == [
        (0.0, 0.0, 0.0), (1.0, 1.0, 0.0), (1.0, 1.0, 0.0)]
    assert [r["consumed_samples"] for r in ref] == [32, 64, 96]
    # the older weights a resume generates on go with each checkpoint: version N for episode N+1
    assert [sorted(r["policy_versions"]) for r in ref] == [["0"], ["1"], ["2"]]
    runs = _stage_runs("async-ref", ["episode-1", "episode-2", "episode-3"], ("generate", "score", "train"))
    assert len(runs) == 9
    # episode N+1 starts generating as episode N's gate opens, its flow run created ahead: its generate runs
    # beside episode N's score and train. Each pair overlaps by a fraction of a second here, and a loaded machine
    # (the API answering late, the episode thread waiting for a core) can miss that window for one pair: the
    # overlap must show in at least one of the two (in the full suite, episode 3's generate once started 0.6 s
    # after episode 2's train ended).
    spans = {n: ((runs[f"episode-{n}", "score"].start_time, runs[f"episode-{n}", "train"].end_time),
                 (runs[f"episode-{n + 1}", "generate"].start_time, runs[f"episode-{n + 1}", "generate"].end_time))
             for n in (1, 2)}
    assert any(gen[0] < busy[1] and gen[1] > busy[0] for busy, gen in spans.values()), spans
    _, ref_rows = killed_and_resumed("grpo_async", tmp_path, "async-ref", "async-killed", "after_generate:1", timing,
                                     tiny_model_dir, monkeypatch, capsys)
    # the policy's own process SIGKILLed at the same point: recreated, and the run redoes episode 2 exactly
    train_here("grpo_async", tmp_path, "async-lost", tiny_model_dir, monkeypatch,
               CHATLEARN_KILL_AT="policy:after_generate:1")
    assert "died during episode 2; recreating the model processes" in capsys.readouterr().err
    expected = load_file(str(tmp_path / "async-ref" / "final" / "policy" / "model.safetensors"))
    weights = load_file(str(tmp_path / "async-lost" / "final" / "policy" / "model.safetensors"))
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert [{k: v for k, v in r.items() if k not in timing} for r in rows_of(tmp_path / "async-lost")] == ref_rows


def test_a_raising_rule_reward_stops_the_run_naming_the_sample(prefect_api, ray_session, tiny_model_dir, tmp_path):
    from flows import train_flow

    # math.sqrt of a sample dict raises TypeError: a stand-in for a reward function with a bug
    cfg = small("grpo", tmp_path, tiny_model_dir, "models.reward.args_dict.reward_fn=math:sqrt",
                "runtime.num_episode=1", "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false")
    expected = r'episode 1, score: reward hook math:sqrt raised TypeError: .* for sample 0 \(prompt "'
    with pytest.raises(Exception, match=expected):
        train_flow(cfg)
    assert not (tmp_path / cfg.runtime.exp_name / "final").exists()


def test_rule_rewards_fan_out_as_prefect_tasks_on_ray_with_their_cpus(prefect_api, ray_session):
    """Each batch's rule reward is a Prefect task on Ray asking for the rule's CPUs: the scores are the
    function's, and a rule asking for more CPUs than the cluster has is never run (Ray keeps it pending)."""
    import ray

    from chatlearn.models.rule import RuleSpec
    from chatlearn.runtime.calls.waiting import StageClock
    from flows.rule_tasks import fan_out_rule

    fn = "chatlearn.tasks.max_digit:max_digit_reward"
    batches = [ray.put({"sample_id": [1, 2], "prompt": ["max 1 2 ?", "max 7 3 ?"], "response": ["2", "1"],
                        "answer": ["2", "7"], "response_ids": torch.zeros(2, 1)}),
               ray.put({"sample_id": [3], "prompt": ["max 5 ?"], "response": ["5"], "answer": ["5"]})]

    def rule(num_cpus):
        return RuleSpec(reward_fn=fn, timeout_s=10, num_cpus=num_cpus)

    clock = StageClock("score", 0, 60)
    futures = fan_out_rule(rule(0.5), "reward", [[b] for b in batches])
    assert [f.result(clock) for f in futures] == [[1.0, pytest.approx(0.5 * (1 - 6 / 9))], [1.0]]
    pending = fan_out_rule(rule(64), "reward", [batches[:1]])[0]
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(pending.ref, timeout=3)
    ray.cancel(pending.ref, force=True)


def test_a_rule_task_reaches_its_worker_without_the_flows_and_their_imports(prefect_api):
    """What a rule-reward task's Ray worker unpickles (the task, its context) imports neither the `flows` package
    nor transformers: the task travels by value, and its parent flow and stage task as stand-ins of the same
    names, with no parameters (a run's first score stage spent 7 s on those imports in new workers, the next 0.2
    s); an env-step task's imports transformers (its tokenizer's), not the `flows` package. Hydrated, the context
    still names the parent flow run, flow and stage task."""
    import pickle

    import ray
    from prefect import flow, task
    from prefect.context import FlowRunContext, TaskRunContext, hydrated_context, serialize_context

    from chatlearn.runtime.prefect.ray_tasks import _light_parent
    from flows.env_steps import env_step
    from flows.rule_tasks import rule_reward

    @task(name="score")
    def stage(ctx: dict) -> tuple[dict, str]:
        context = serialize_context()
        _light_parent(context)
        return context, str(FlowRunContext.get().flow_run.id)

    @flow(name="episode")
    def episode(ctx: dict) -> tuple[dict, str]:
        return stage(ctx)

    context, flow_run_id = episode({"spec": "the run's context"})
    assert context["flow_run_context"]["parameters"] == context["task_run_context"]["parameters"] == {}
    payload = ray.cloudpickle.dumps((rule_reward, context))
    # the rule task and its context, then the env-step task (its tokenizer needs transformers, its flows nothing)
    script = ("import pickle, sys\nfor part in pickle.loads(sys.stdin.buffer.read()):\n    pickle.loads(part)\n"
              "    print(sorted(m for m in ('flows', 'transformers') if m in sys.modules))")
    parts = pickle.dumps((payload, ray.cloudpickle.dumps(env_step)))
    seen = subprocess.run([sys.executable, "-c", script], input=parts, capture_output=True, cwd=REPO, timeout=120)
    assert seen.stdout.decode().splitlines() == ["[]", "['transformers']"], seen.stderr.decode()[-2000:]
    with hydrated_context(pickle.loads(payload)[1]):
        assert FlowRunContext.get().flow.name == "episode" and str(FlowRunContext.get().flow_run.id) == flow_run_id
        assert TaskRunContext.get().task.name == "score"


# -- who owns an episode's batches (issue 24, item 5) ---------------------------------------------------------

def owner_of(ref) -> str:
    """The worker id (hex) of the process that owns ``ref``: when it dies, the object is gone."""
    from ray.core.generated.common_pb2 import Address

    address = Address()
    address.ParseFromString(ref.owner_address())
    return address.worker_id.hex()


def sigkill_and_wait(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it is gone (reaped by its parent, the raylet)."""
    import time

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # dead, not reaped yet
                    break
        except OSError:
            break
        time.sleep(0.05)
    time.sleep(0.5)  # the raylet has seen the socket close: no new task is leased to it


def test_a_batch_is_the_drivers_and_outlives_the_process_that_made_it(ray_session):
    """A model call's batch and the StreamDataset's samples are return values the driver owns, not objects the
    worker put itself (which died with it): each is read after the process that made it is SIGKILLed. Larger
    than Ray inlines (100 KB), so they sit in the object store, made by the killed process."""
    import ray

    from chatlearn.config import ModelConfig, RuntimeConfig
    from chatlearn.models.hf.reward import RuleReward
    from chatlearn.runtime.calls.handles import ModelHandle, ReplicaHandle
    from chatlearn.runtime.calls.waiting import StageClock
    from chatlearn.runtime.cluster.stream_dataset import StreamDataset
    from chatlearn.runtime.cluster.worker import Worker

    driver = ray.get_runtime_context().get_worker_id()
    rt = RuntimeConfig(sample_per_episode=2)
    cfg = ModelConfig(args_dict={"reward_fn": "chatlearn.tasks.max_digit:max_digit_reward"})
    worker = ray.remote(Worker).options(num_cpus=0, max_restarts=0).remote([("reward", RuleReward("reward"), cfg,
                                                                               0, 0)], rt, 0, {})
    stream = ray.remote(StreamDataset).options(num_cpus=0, max_restarts=0).remote(rt)
    try:
        pid = ray.get(worker.run.remote("reward", "setup"), timeout=120)["pid"]
        pad = torch.arange(2 * 200 * 200, dtype=torch.float32).view(2, 200, 200)  # 320 KB, a block per sample
        batch = {"sample_id": [0, 1], "prompt": ["max 1 2 ?", "max 7 3 ?"], "response": ["2", "1"],
                 "answer": ["2", "7"], "pad": pad}
        clock = StageClock("score", 0, 120)
        call = ReplicaHandle([ModelHandle(worker, "reward", "w")]).forward.remote(batch, keep_inputs=True,
                                                                                   flow_method="score_step")
        assert clock.get(call) is True  # the stage waits on `done`; the batch stays where it was made
        assert owner_of(call.batch) == driver
        stats, samples, _ = stream.episode_samples.remote([[call.batch]], episode=0)
        assert clock.get(stats)["num_samples"] == 2 and owner_of(samples) == driver

        sigkill_and_wait(pid)
        stream_pid = ray.get(stream.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        sigkill_and_wait(stream_pid)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.ping.remote(), timeout=30)
        out = ray.get(call.batch, timeout=30)
        assert out["rewards/reward"].tolist() == [1.0, pytest.approx(0.5 * (1 - 6 / 9))]
        assert torch.equal(out["pad"], pad)
        assert [(s["sample_id"], torch.equal(s["pad"], pad[i])) for i, s in enumerate(ray.get(samples, timeout=30))] \
            == [(0, True), (1, True)]
    finally:
        for actor in (worker, stream):
            ray.kill(actor, no_restart=True)


def idle_task_workers() -> list[int]:
    """Pids of the session Ray's idle task workers (its raylet's children that Ray titles ``ray::IDLE``): the
    processes that ran an episode's steps and rule-reward tasks, once those returned."""
    from chatlearn.runtime.cluster import ray_private

    raylet = ray_private.local_ray_processes()["raylet"][0].pid
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        if ppid == raylet and title.startswith(b"ray::IDLE"):
            pids.append(int(entry))
    return pids


def test_killing_the_workers_that_made_an_episodes_batches_leaves_the_run_undisturbed(
        prefect_api, ray_session, tiny_model_dir, tmp_path, monkeypatch):
    """examples/custom_engine.yaml: its filter step runs as Ray tasks and its two rule rewards as Prefect tasks on
    Ray. Every batch the stages hand on (each ref in a RefBox) is the driver's; once the score stage has handed
    its batches on, every Ray task worker that made or read them is SIGKILLed, and the run trains on them and
    ends as the undisturbed run does: the same rows, the same final weights, bit for bit."""
    import ray

    from chatlearn.runtime.calls.handles import RefBox
    from chatlearn.runtime.calls.waiting import StageClock
    from flows import train_flow

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    # the session's Ray has no runtime_env with the config's folder: the example's step travels by value
    monkeypatch.syspath_prepend(os.path.join(REPO, "examples"))
    import custom_engine

    ray.cloudpickle.register_pickle_by_value(custom_engine)
    driver = ray.get_runtime_context().get_worker_id()
    owners, killed, disturb = [], [], [False]
    box, clock_init = RefBox.__init__, StageClock.__init__

    # patched on classes, which Ray pickles by reference (a stage task's globals travel by value with the Prefect
    # context of every rule-reward task, and this module is no module a worker can import)
    def recording_box(self, refs, **meta):
        box(self, refs, **meta)
        owners.extend(owner_of(r) for part in refs for r in (part if isinstance(part, list) else [part])
                      if isinstance(r, ray.ObjectRef))

    def clock_after_killing(self, stage, episode, timeout_s):  # the train stage's first step, once score handed
        if disturb[0] and stage == "train":  # its batches on
            for pid in idle_task_workers():
                sigkill_and_wait(pid)
                killed.append(pid)
        clock_init(self, stage, episode, timeout_s)

    monkeypatch.setattr(RefBox, "__init__", recording_box)
    monkeypatch.setattr(StageClock, "__init__", clock_after_killing)
    args = ["runtime.num_episode=2", "runtime.sample_per_episode=32", "runtime.generation_batch_size=16",
            "runtime.train_micro_batch_size=16", "runtime.train_global_batch_size=32",
            "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false"]
    try:
        for kill, exp in ((False, "undisturbed"), (True, "killed")):
            disturb[0] = kill
            train_flow(config_path="examples/custom_engine.yaml", overrides=[*args, f"runtime.exp_name={exp}"])
    finally:
        ray.cloudpickle.unregister_pickle_by_value(custom_engine)
    assert owners and set(owners) == {driver}
    assert len(killed) >= 2  # the step's worker and the rule rewards', each episode

    timing = ("episode_seconds", "stage_seconds", "peak_memory_mb", "startup_seconds", "checkpoint_paths")

    def rows(exp):
        return [{k: v for k, v in r.items() if k not in timing} for r in rows_of(tmp_path / exp)]

    assert rows("killed") == rows("undisturbed") and [r["episode"] for r in rows("killed")] == [1, 2]
    expected = load_file(str(tmp_path / "undisturbed" / "final" / "policy" / "model.safetensors"))
    weights = load_file(str(tmp_path / "killed" / "final" / "policy" / "model.safetensors"))
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


def test_multi_turn_grpo_steps_environments_as_task_runs_and_resumes_bit_identical(prefect_api, ray_session,
                                                                                   tiny_model_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    """configs/agent_higher_lower.yaml (runtime.task_type: agent) for two episodes: the conversations run over
    several turns (each environment step an `env-step` task run of its episode in the API), the episode rows carry
    the agent metrics; a `chatlearn train` process SIGKILLed between two turns of episode 2's conversations, then
    the same run again: the uninterrupted run's final policy and rows, bit for bit."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    timing = ("episode_seconds", "stage_seconds", "peak_memory_mb", "startup_seconds", "checkpoint_paths",
              "env_seconds", "agent_seconds")
    train_here("agent_higher_lower", tmp_path, "agent-ref", tiny_model_dir, monkeypatch)
    ref = rows_of(tmp_path / "agent-ref")
    assert len(ref) == 2
    for row in ref:
        assert 1.0 < row["turns_mean"] <= 4.0 and row["tool_calls_mean"] == 0.0 and row["tool_errors"] == 0.0
        assert row["env_seconds"] > 0 and 0.0 <= row["env_reward_mean"] <= 1.0
    assert 1.0 <= ref[1]["eval_turns_mean"] <= 4.0 and ref[1]["eval_tool_errors"] == 0.0
    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(
            any_=["episode-1"]))) if _exp_name(r) == "agent-ref"]
        assert len(runs) == 1
        deadline = time.monotonic() + 30
        while True:
            steps = {t.name: t for t in client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[runs[0].id]))) if t.name.startswith("env-step-")}
            if "env-step-turn-2-batch-0" in steps or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    # two batches of 16 conversations, each stepped after every turn while any of them goes on
    assert {"env-step-turn-1-batch-0", "env-step-turn-1-batch-1", "env-step-turn-2-batch-0"} <= set(steps)
    assert all(t.state_type.value == "COMPLETED" for t in steps.values())
    killed_and_resumed("agent_higher_lower", tmp_path, "agent-ref", "agent-killed", "agent_turn_2:1", timing,
                       tiny_model_dir, monkeypatch, capsys)
