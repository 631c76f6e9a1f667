"""`runtime.rollout_engine: vllm` with the real vLLM CPU build (`make setup` installs it): the engine against the
Hugging Face model it generates for (log-probs, per-request seeds, weights pushed in place), and GRPO episodes
whose on-policy steps show that vLLM sampled on the trainer's weights."""

import pytest
import torch

from chatlearn.models.hf.policy import response_mask_to_stop
from tests.test_engine_runs import rows_of, small
from tests.test_rollout_engines import first_stops

ARCHITECTURES = ["tiny_model_dir", "tiny_qwen2_dir"]  # the embedded Llama; a tied GQA Qwen2


def trainer_logprobs(model, prompt_ids, prompt_mask, response_ids, temperature):
    """Each response token's log-prob as the trainers compute it (`response_logprobs`: temperature-scaled, whole
    vocabulary; 0 after a response's EOS, id 2)."""
    from chatlearn.models.hf.common import response_logprobs

    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
             "response_mask": response_mask_to_stop(response_ids, 2)}
    with torch.no_grad():
        return response_logprobs(model, batch, torch.device("cpu"), temperature)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ARCHITECTURES)
def test_the_engine_samples_per_request_and_follows_the_models_weights(fixture, request):
    from transformers import AutoModelForCausalLM

    from chatlearn.models.hf.policy import PolicyInference  # noqa: F401  registers the engines
    from chatlearn.models.hf.rollout import Request, make_engine

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture), dtype=torch.float32).eval()
    engine = make_engine("vllm", model, "models.policy")
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7], [0, 9, 8, 7, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])

    def generate(rows, sample_ids, stops=()):
        return engine.generate(Request(prompt_ids=ids[rows], prompt_mask=mask[rows], max_new_tokens=6,
                                       min_new_tokens=0, eos_token_id=2, pad_token_id=0, do_sample=True,
                                       sample_ids=sample_ids, seed=7, temperature=0.7, stop_token_ids=stops))

    batch, logprobs = generate([0, 1, 2], [10, 11, 12])
    assert batch.shape == (3, 6)
    # the sampled tokens' log-probs are the trainer's (temperature-scaled, whole vocabulary) within 1e-4 (float32
    # kernels of two libraries)
    torch.testing.assert_close(logprobs, trainer_logprobs(model, ids, mask, batch, 0.7), atol=1e-4, rtol=0)
    # a sample's draw is its own: alone, or after another in a batch of two, the same tokens
    alone, _ = generate([2], [12])
    pair, _ = generate([1, 2], [11, 12])
    alone, pair = (torch.nn.functional.pad(t, (0, 6 - t.shape[1])) for t in (alone, pair))  # pad id 0 to 6 tokens
    assert torch.equal(alone[0], batch[2]) and torch.equal(pair[1], batch[2]) and torch.equal(pair[0], batch[1])
    # stop tokens (the policy's stop_token_list): each response is the unstopped draw up to and with its first one
    stops = (int(batch[0, 2]), int(batch[1, 1]))
    stopped, stopped_logprobs = generate([0, 1, 2], [10, 11, 12], stops)
    want = first_stops(batch, response_mask_to_stop(batch, 2), (2, *stops))
    assert want[0] <= 3 and want[1] <= 2
    assert response_mask_to_stop(stopped, (2, *stops)).sum(-1).long().tolist() == want
    for row, n in enumerate(want):
        assert torch.equal(stopped[row, :n], batch[row, :n]) and (stopped[row, n:] == 0).all()
        torch.testing.assert_close(stopped_logprobs[row, :n], logprobs[row, :n], atol=1e-5, rtol=0)

    # a continued response (a conversation's next turn, a partial rollout's next round): its prompt and first 3
    # tokens go in as token ids; the rest is drawn per request (the same alone) from the step it starts at, with
    # the trainer's log-probs over the whole context
    cont_ids = torch.cat([ids, batch[:, :3]], dim=1)
    cont_mask = torch.cat([mask, torch.ones(3, 3, dtype=torch.long)], dim=1)

    def continued(rows, sample_ids):
        return engine.generate(Request(prompt_ids=cont_ids[rows], prompt_mask=cont_mask[rows], max_new_tokens=4,
                                       min_new_tokens=0, eos_token_id=2, pad_token_id=0, do_sample=True,
                                       sample_ids=sample_ids, seed=7, temperature=0.7, first_steps=[3] * len(rows)))

    more, more_logprobs = continued([0, 1, 2], [10, 11, 12])
    torch.testing.assert_close(more_logprobs, trainer_logprobs(model, cont_ids, cont_mask, more, 0.7), atol=1e-4,
                               rtol=0)
    one, _ = continued([1], [11])
    assert torch.equal(torch.nn.functional.pad(one, (0, more.shape[1] - one.shape[1]))[0], more[1])

    # the policy's weights change in place (a checkpoint load, published weights): the next generate pushes them,
    # and samples on them
    assert engine.sync_seconds == 0.0

    def perturb(seed):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)

    perturb(0)
    after, after_logprobs = generate([0, 1, 2], [10, 11, 12])
    assert engine.sync_seconds > 0 and not torch.equal(after, batch)
    torch.testing.assert_close(after_logprobs, trainer_logprobs(model, ids, mask, after, 0.7), atol=1e-4, rtol=0)
    # the sync stage's write: pushed at once (its time the sync's), not again at the generate
    perturb(1)
    engine.sync_seconds = 0.0
    engine.weights_synced()
    assert engine.sync_seconds > 0
    engine.sync_seconds = 0.0
    synced, synced_logprobs = generate([0, 1, 2], [10, 11, 12])
    assert engine.sync_seconds == 0.0 and not torch.equal(synced, after)
    torch.testing.assert_close(synced_logprobs, trainer_logprobs(model, ids, mask, synced, 0.7), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_the_policys_vllm_settings_reach_the_engine_and_one_that_cannot_start_is_one_line(tiny_model_dir):
    """`max_model_len`, `kv_cache_space_gb`, `max_num_seqs` from the policy's args: the engine runs with them (two
    sequences at a time, the third waits) and draws what a default engine drew for the same seeds (a sample's draw
    does not depend on the engine's scheduling, nor on which engine of the same weights, started anew); a KV cache
    too small for one sequence is one RunError naming the policy and the fields."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from chatlearn.models.hf.policy import PolicyInference  # noqa: F401  registers the engines
    from chatlearn.models.hf.rollout import Request, make_engine
    from chatlearn.utils.errors import RunError

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7], [0, 9, 8, 7, 6]])
    mask = (ids != 0).long()
    req = Request(prompt_ids=ids, prompt_mask=mask, max_new_tokens=6, min_new_tokens=0, eos_token_id=2,
                  pad_token_id=0, do_sample=True, sample_ids=[10, 11, 12], seed=7, temperature=0.7)
    drawn = []
    for args in (None, SimpleNamespace(max_model_len=64, kv_cache_space_gb=0.01, max_num_seqs=2)):
        engine = make_engine("vllm", model, "models.policy (tiny)", args=args)
        config = engine.llm.llm_engine.vllm_config
        if args is not None:
            assert config.model_config.max_model_len == 64 and config.scheduler_config.max_num_seqs == 2
        drawn.append(engine.generate(req))
        del engine
    assert torch.equal(drawn[0][0], drawn[1][0]) and torch.equal(drawn[0][1], drawn[1][1])
    # top-k, top-p and min_new_tokens at temperature 1: each drawn token is among the step's 3 most likely, EOS
    # (id 2) is not drawn before the fourth token, and the log-probs are the trainer's over the whole vocabulary
    filtered = dict(top_k=3, top_p=0.9, min_new_tokens=3)
    engine = make_engine("vllm", model, "models.policy (tiny)", args=SimpleNamespace(**filtered, temperature=1.0))
    kept = Request(prompt_ids=ids, prompt_mask=mask, max_new_tokens=8, eos_token_id=2, pad_token_id=0,
                   do_sample=True, sample_ids=[10, 11, 12], seed=7, temperature=1.0, **filtered)
    out, out_logprobs = engine.generate(kept)
    torch.testing.assert_close(out_logprobs, trainer_logprobs(model, ids, mask, out, 1.0), atol=1e-4, rtol=0)
    assert not (out[:, :3] == 2).any()
    live = response_mask_to_stop(out, 2).long()  # (pad is id 0, a token the tiny model draws too)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, out], 1), attention_mask=torch.cat([mask, live], 1)).logits
    steps = logits[:, ids.shape[1] - 1:-1].clone()
    steps[:, :3, 2] = float("-inf")  # EOS is banned before top-k keeps the 3 (as the other engines do)
    top3 = steps.topk(3, dim=-1).indices
    assert ((top3 == out.unsqueeze(-1)).any(-1) | (live == 0)).all()
    with pytest.raises(ValueError, match="started for the sampling filters"):  # the mode was chosen for its args
        engine.generate(Request(prompt_ids=ids, prompt_mask=mask, max_new_tokens=4, min_new_tokens=0,
                                eos_token_id=2, pad_token_id=0, do_sample=True, sample_ids=[10, 11, 12], seed=7,
                                temperature=1.0))
    del engine
    for settings, said in (({"max_model_len": 64, "kv_cache_space_gb": 1e-5}, "No available memory for the cache"),
                           ({"max_model_len": 128}, "max_model_len (128) is greater than")):  # the model has 64
        with pytest.raises(RunError) as err:
            make_engine("vllm", model, "models.policy (tiny)", args=SimpleNamespace(**settings))
        message = str(err.value)
        assert "\n" not in message and message.startswith(
            f"models.policy (tiny): vLLM could not start (max_model_len {settings['max_model_len']}, "
            "kv_cache_memory_bytes "), message
        assert "kv_cache_space_gb" in message and said in message, message


def test_the_engine_asks_for_intel_openmp_unless_the_run_was_started_with_an_openmp(monkeypatch):
    """vLLM's CPU build on x86 wants Intel's OpenMP preloaded: the policy's process is started with it (the stuck
    engine's test below finds it mapped there), before an LD_PRELOAD the run was started with, unless that one
    names an OpenMP already. The rule reads the starting environment, not os.environ, which vLLM rewrites with
    torch's libgomp once it ran in a process (here as it would be)."""
    import sys

    from chatlearn.models.hf import vllm_engine

    lib = f"{sys.prefix}/lib/libiomp5.so"
    monkeypatch.setenv("LD_PRELOAD", "torch/lib/libgomp.so.1")
    for given, asked in [("", {"LD_PRELOAD": lib}), ("/opt/libtrace.so", {"LD_PRELOAD": f"{lib}:/opt/libtrace.so"}),
                         (lib, {}), ("/usr/lib/libgomp.so.1", {})]:
        monkeypatch.setattr(vllm_engine, "started_with", lambda name, given=given: given)
        assert vllm_engine.VLLMEngine.process_env() == asked, given


def test_started_with_is_the_environment_the_process_began_with():
    """`started_with` reads the environment the process was started with: a variable changed or set since reads
    as it was (unset: empty)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import os; os.environ['CHATLEARN_PROBE'] = 'changed'; os.environ['CHATLEARN_LATER'] = 'set'; "
            "from chatlearn.utils.environ import started_with; "
            "print(repr((started_with('CHATLEARN_PROBE'), started_with('CHATLEARN_LATER'))))")
    env = {k: v for k, v in os.environ.items() if k != "CHATLEARN_LATER"}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, CHATLEARN_PROBE="as started"),
                         capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    assert out == repr(("as started", ""))


# the Llama's policy (vLLM in it) in a process of its own, synced over the collective route (gloo broadcast); the
# Qwen2's colocated with the trainer (an in-process copy)
LAYOUTS = {"tiny_model_dir": ["runtime.colocation=['reference,reward,ppo_policy']"], "tiny_qwen2_dir": []}


@pytest.mark.integration
@pytest.mark.parametrize("fixture", ARCHITECTURES)
def test_grpo_with_vllm_trains_on_the_weights_it_sampled_with(prefect_api, ray_session, fixture, request, tmp_path):
    """Two GRPO episodes, one step each, the trainer scoring the samples (`old_logprobs: trainer`): the episode's
    mismatch metrics compare vLLM's log-probs with the trainer's, token by token, and are ~0 only if vLLM sampled
    on the trainer's weights, episode 2 on those synced after episode 1. On the Llama, its policy a replica of its
    own that the weights reach over gloo, and on the tied GQA Qwen2, colocated (its one embedding matrix, trained
    as the output layer too, reaches vLLM's tied head)."""
    from flows import train_flow

    cfg = small("grpo", tmp_path, request.getfixturevalue(fixture), "runtime.train_global_batch_size=32",
                "runtime.rollout_engine=vllm", "models.ppo_policy.args_dict.old_logprobs=trainer", *LAYOUTS[fixture])
    assert ("policy" in cfg.runtime.colocation[0].split(",")) == (fixture == "tiny_qwen2_dir")
    train_flow(cfg)
    rows = rows_of(tmp_path / cfg.runtime.exp_name)
    assert [r["episode"] for r in rows] == [1, 2] and all(r["num_samples"] == 32 for r in rows)
    for r in rows:  # float32 on both sides: what is left is kernel rounding
        assert r["rollout_logprob_diff_max"] < 1e-4 and r["rollout_kl"] < 1e-8, r
        assert r["approx_kl"] == pytest.approx(0.0, abs=1e-5) and r["clipfrac"] == 0.0, r
    assert rows[1]["kl_loss"] > 0 and "eval_exact_match" in rows[1]


@pytest.mark.integration
def test_multi_turn_agent_with_vllm_continues_conversations_as_token_ids(prefect_api, ray_session, tiny_model_dir,
                                                                        tmp_path):
    """configs/agent_higher_lower.yaml on vLLM for one episode: the conversations go on over several turns (vLLM
    continues each from its token ids, the environment's observation tokens included), and the trainer's own
    log-probs of the policy's tokens equal vLLM's (mismatch ~0): nothing was re-tokenized or shifted."""
    from flows import train_flow

    cfg = small("agent_higher_lower", tmp_path, tiny_model_dir, "runtime.num_episode=1",
                "runtime.rollout_engine=vllm", "models.ppo_policy.args_dict.old_logprobs=trainer")
    train_flow(cfg)
    [row] = rows_of(tmp_path / cfg.runtime.exp_name)
    assert row["num_samples"] == 32 and 1.0 < row["turns_mean"] <= 4.0, row
    assert row["rollout_logprob_diff_max"] < 1e-4 and row["rollout_kl"] < 1e-8, row


@pytest.mark.integration
def test_a_stuck_engine_hits_the_stage_deadline_and_its_process_goes(ray_session, tiny_model_dir, tmp_path):
    """The policy's process frozen (SIGSTOP: as an engine stuck in a kernel or a lock, it neither answers nor dies):
    the generate stage's wait ends at `runtime.stage_timeout_s` with one line naming the episode, the stage and the
    policy, and the run's teardown takes the frozen process, vLLM's engine in it, down."""
    import os
    import signal
    import time

    import psutil
    import ray

    from chatlearn.config import load_config
    from chatlearn.models.hf.policy import PolicyInference
    from chatlearn.models.hf.vllm_engine import VLLMEngine
    from chatlearn.runtime.calls.waiting import StageClock, StageTimeout
    from chatlearn.runtime.cluster.model_group import cluster_nodes, setup_models, start_workers
    from chatlearn.runtime.cluster.placement import plan_placement
    from chatlearn.tasks.max_digit import make_records

    cfg = load_config({"models": {"policy": {"num_cpu": 1, "args_dict": {"model_path": tiny_model_dir,
                                                                          "max_new_tokens": 8}}},
                       "runtime": {"rollout_engine": "vllm", "output_dir": str(tmp_path), "exp_name": "stuck"}},
                      checks=[])
    nodes, ids = cluster_nodes()
    modules = {"policy": PolicyInference("policy")}
    workers = start_workers(plan_placement(cfg, list(modules), nodes), ids, cfg, modules)
    try:
        [info] = setup_models(workers, True, 600)["policy"]
        head = workers.groups["policy"].heads[0]
        clock = StageClock("generate", 0, timeout_s=60.0)
        clock.get(head.build_dataset.remote(make_records(4, seed=1)))  # a handle's call: a `Call` of its ranks
        call = head.generate.remote([0, 1, 2, 3], 0, sample_ids=[0, 1, 2, 3])
        assert clock.get(call) is True  # a batch stays where it was made: its ref is the call's `batch`
        assert ray.get(call.batch)["response_ids"].shape[0] == 4  # the engine answers
        process = psutil.Process(info["pid"])
        # the process started with Intel's OpenMP preloaded (VLLMEngine.process_env), as vLLM's CPU docs set it
        [preload] = VLLMEngine.process_env()["LD_PRELOAD"].split(":")[:1]
        assert preload.endswith("libiomp5.so") and preload in {m.path for m in process.memory_maps()}
        os.kill(info["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(StageTimeout) as err:
            StageClock("generate", 0, timeout_s=3.0).get(head.generate.remote([0, 1], 1, sample_ids=[4, 5]))
        assert str(err.value) == ("episode 1, generate: no result after 3 s from policy (runtime.stage_timeout_s); "
                                  "the model is stuck or the limit is too low")
        assert time.monotonic() - t0 < 10
    finally:
        workers.kill()
    gone = time.monotonic() + 30
    while time.monotonic() < gone and process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.2)
    assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE, "the frozen process is left"
