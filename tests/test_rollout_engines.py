"""Rollout engines (`runtime.rollout_engine`): continuous batching draws what one `generate` per batch draws.

The models are the embedded tiny Llama and a tiny Qwen2 with tied embeddings and GQA; a forward hook raises
EOS's logit so responses end at many different lengths (what continuous batching is for).
"""

import dataclasses

import pytest
import torch

from chatlearn.config import ConfigError, EngineChecks, load_config
from chatlearn.models.hf.common import load_causal_lm, load_tokenizer
from chatlearn.models.hf.policy import PolicyInference, response_mask_to_stop
from chatlearn.models.hf.rollout import (
    ROLLOUT_ENGINES,
    HFGenerate,
    Request,
    RolloutEngine,
    make_engine,
    register_rollout_engine,
)
from chatlearn.tasks.max_digit import make_records
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig
from tests.conftest import REPO

DEFAULT = f"{REPO}/configs/default.yaml"


def eos_biased(path: str, bias: float):
    model = load_causal_lm(path).eval()
    tok = load_tokenizer(path)
    lift = torch.zeros(model.config.vocab_size)
    lift[tok.eos_token_id] = bias
    model.lm_head.register_forward_hook(lambda _m, _i, out: out + lift)
    return model, tok


def make_request(tok, n: int, **kw) -> Request:
    records = make_records(n, seed=11)
    enc = tok([r["prompt"][: 3 + 5 * (i % 4)] for i, r in enumerate(records)], padding=True, return_tensors="pt")
    return Request(prompt_ids=enc["input_ids"], prompt_mask=enc["attention_mask"], max_new_tokens=24,
                   min_new_tokens=kw.pop("min_new_tokens", 0), eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id, **kw)


def masked(response_ids: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = response_mask_to_stop(response_ids, eos)
    return torch.where(mask.bool(), response_ids, -1), mask


@pytest.fixture(scope="module", params=["llama", "qwen2_tied_gqa"])
def biased(request, tiny_model_dir, tiny_qwen2_dir):
    path = tiny_model_dir if request.param == "llama" else tiny_qwen2_dir
    return eos_biased(path, 4.0)


@pytest.mark.parametrize("slots", [3, 64])
def test_continuous_batching_draws_the_same_tokens_and_logprobs_as_one_generate(biased, slots):
    model, tok = biased
    req = make_request(tok, 12, do_sample=True, sample_ids=list(range(40, 52)), seed=5, max_num_seqs=slots)
    with torch.no_grad():
        hf_ids, hf_lp = ROLLOUT_ENGINES["hf"](model).generate(req)
        cb_ids, cb_lp = ROLLOUT_ENGINES["continuous"](model).generate(req)
    hf_tokens, mask = masked(hf_ids, tok.eos_token_id)
    cb_tokens, cb_mask = masked(cb_ids, tok.eos_token_id)
    lengths = mask.sum(-1)
    assert len(set(lengths.tolist())) >= 4 and lengths.min() < 24  # the work continuous batching is for
    assert torch.equal(cb_tokens, hf_tokens) and torch.equal(cb_mask, mask)
    assert (cb_lp * (1 - cb_mask) == 0).all()
    torch.testing.assert_close(cb_lp * mask, hf_lp * mask, atol=1e-5, rtol=0)


def test_greedy_and_min_new_tokens_are_honoured_alike(biased):
    model, tok = biased
    req = make_request(tok, 9, min_new_tokens=5, max_num_seqs=4)
    with torch.no_grad():
        hf_ids, hf_lp = ROLLOUT_ENGINES["hf"](model).generate(req)
        cb_ids, cb_lp = ROLLOUT_ENGINES["continuous"](model).generate(req)
    assert hf_lp is None and cb_lp is None
    hf_tokens, mask = masked(hf_ids, tok.eos_token_id)
    assert torch.equal(masked(cb_ids, tok.eos_token_id)[0], hf_tokens)
    assert (mask.sum(-1) >= 5).all() and (mask.sum(-1) < 24).any()


def test_the_policy_generates_the_same_samples_with_either_engine(tiny_model_dir):
    outs = {}
    for engine in ("hf", "continuous"):
        policy = PolicyInference("policy")
        policy.bind(ModelConfig(num_cpu=1, args_dict={"model_path": tiny_model_dir, "max_new_tokens": 6,
                                                       "max_num_seqs": 2}),
                    RuntimeConfig(rollout_engine=engine), 0, seed=7)
        policy.setup()
        batch = policy.collate_fn(policy.build_dataset(make_records(5, seed=3)))
        batch["sample_id"] = [7, 8, 9, 10, 11]
        outs[engine] = policy.forward_step(batch, iteration=2)
    hf, cb = outs["hf"], outs["continuous"]
    assert cb["response"] == hf["response"]
    assert torch.equal(cb["response_ids"], hf["response_ids"]) and torch.equal(cb["response_mask"], hf["response_mask"])
    torch.testing.assert_close(cb["logprobs"], hf["logprobs"], atol=1e-5, rtol=0)


def first_stops(tokens: torch.Tensor, mask: torch.Tensor, stops: tuple[int, ...]) -> list[int]:
    """Each row's length when it ends at its first token of ``stops`` (kept), within its unstopped ``mask``."""
    lengths = []
    for row, m in zip(tokens.tolist(), mask.sum(-1).long().tolist(), strict=True):
        hits = [i for i, t in enumerate(row[:m]) if t in stops]
        lengths.append(hits[0] + 1 if hits else m)
    return lengths


def common_tokens(tokens: torch.Tensor, mask: torch.Tensor, skip: int, k: int) -> tuple[int, ...]:
    """The ``k`` tokens drawn most often after the first step (not ``skip``): stops that cut many rows."""
    counts = torch.bincount(tokens[:, 1:][mask[:, 1:].bool()])
    counts[skip] = 0
    return tuple(counts.topk(k).indices.tolist())


@pytest.mark.parametrize("arch", ["llama", "qwen2_tied_gqa"])
def test_a_stop_token_ends_a_response_where_the_unstopped_draw_has_it_first(arch, tiny_model_dir, tiny_qwen2_dir):
    """`Request.stop_token_ids` (the policy's `stop_token_list`): each engine ends a response at its first stop
    token, kept as its last token, and what comes before is the draw without stops, token and log-prob (a token's
    noise depends on its step only); before min_new_tokens a stop token is banned as EOS is."""
    model, tok = eos_biased(tiny_model_dir if arch == "llama" else tiny_qwen2_dir, 0.0)  # long responses
    free = make_request(tok, 12, do_sample=True, sample_ids=list(range(40, 52)), seed=5, max_num_seqs=4)
    with torch.no_grad():
        base, base_lp = ROLLOUT_ENGINES["hf"](model).generate(free)
    _, base_mask = masked(base, tok.eos_token_id)
    stops = common_tokens(base, base_mask, tok.eos_token_id, 3)
    req = dataclasses.replace(free, stop_token_ids=stops)
    assert req.stops == (tok.eos_token_id, *stops)
    want = first_stops(base, base_mask, req.stops)
    assert sum(w < m for w, m in zip(want, base_mask.sum(-1).long().tolist(), strict=True)) >= 6  # rows cut
    for name in ("hf", "continuous"):
        with torch.no_grad():
            ids, lp = ROLLOUT_ENGINES[name](model).generate(req)
        mask = response_mask_to_stop(ids, req.stops)
        assert mask.sum(-1).long().tolist() == want, name
        for row, n in enumerate(want):
            assert torch.equal(ids[row, :n], base[row, :n]), name
            assert (ids[row, n:] == tok.pad_token_id).all(), name  # the row stopped decoding there
            torch.testing.assert_close(lp[row, :n], base_lp[row, :n], atol=1e-5, rtol=0)
        with torch.no_grad():
            late, _ = ROLLOUT_ENGINES[name](model).generate(dataclasses.replace(req, min_new_tokens=3))
        assert not torch.isin(late[:, :3], torch.tensor(req.stops)).any(), name
        assert (response_mask_to_stop(late, req.stops).sum(-1) < 24).any()  # the stops still end responses


def test_stop_token_list_takes_chatlearns_string_and_refuses_what_is_not_one_token(tiny_model_dir):
    from types import SimpleNamespace

    from chatlearn.models.hf.policy import PolicyArgs, stop_token_ids

    tok = load_tokenizer(tiny_model_dir)  # character tokens; EOS is "</s>", id 2
    where = "models.policy.args_dict.stop_token_list"
    assert PolicyArgs(model_path=tiny_model_dir, stop_token_list="</s>;7").stop_token_list == ["</s>", "7"]
    config = SimpleNamespace(eos_token_id=2)
    assert stop_token_ids(tok, config, ["</s>", "7"], where) == (tok.convert_tokens_to_ids("7"),)  # EOS is EOS
    # an id, a token's text, the generation config's other EOS ids (as vLLM and Hugging Face stop on them), once
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=[2, 5]), [9, ",", 9], where) == (
        5, 9, tok.convert_tokens_to_ids(","))
    with pytest.raises(ValueError, match=rf"^{where}: '<EOS>' is 5 tokens of the policy's tokenizer "
                                         r"\(\[3, 3, 3, 3, 23\]\), not one; stop strings of several tokens are "
                                         "not supported yet"):
        stop_token_ids(tok, config, ["<EOS>"], where)
    with pytest.raises(ValueError, match=rf"^{where}: token id 50 is outside the tokenizer's 50 tokens"):
        stop_token_ids(tok, config, [50], where)
    # from a config: refused by the preflight, before anything starts, in one line naming the field
    from chatlearn.data.preflight import check_model_files

    cfg = load_config(DEFAULT, [f"models.policy.args_dict.model_path={tiny_model_dir}",
                                "models.policy.args_dict.stop_token_list=7;<EOS>"], checks=[])
    assert cfg.models["policy"].args_dict["stop_token_list"] == "7;<EOS>"
    with pytest.raises(ConfigError) as err:
        check_model_files(cfg, {"policy": PolicyInference("policy")})
    assert err.value.problems == [f"{where}: '<EOS>' is 5 tokens of the policy's tokenizer ([3, 3, 3, 3, 23]), "
                                  "not one; stop strings of several tokens are not supported yet: list single tokens"]
    ok = load_config(DEFAULT, [f"models.policy.args_dict.model_path={tiny_model_dir}",
                               "models.policy.args_dict.stop_token_list=7;</s>"], checks=[])
    check_model_files(ok, {"policy": PolicyInference("policy")})


def test_the_policy_stops_at_its_stop_token_list_alike_in_either_engine(tiny_model_dir):
    """`stop_token_list` on the policy: the samples are the unstopped ones cut after their first stop token, the
    text keeps the stop token's text, and a partial rollout's response that ended at one is finished."""
    def samples(engine, **args):
        policy = PolicyInference("policy")
        policy.bind(ModelConfig(num_cpu=1, args_dict={"model_path": tiny_model_dir, "max_new_tokens": 24,
                                                       "max_num_seqs": 2, **args}),
                    RuntimeConfig(rollout_engine=engine), 0, seed=7)
        policy.setup()
        batch = policy.collate_fn(policy.build_dataset(make_records(8, seed=3)))
        batch["sample_id"] = list(range(20, 28))
        batch["max_generate_token_length"] = [12] * 8  # a partial rollout's first round, of 12 of the 24 tokens
        return policy.tokenizer, policy.forward_step(batch, iteration=2)

    tok, free = samples("hf")
    stops = common_tokens(free["response_ids"], free["response_mask"], tok.eos_token_id, 2)
    texts = [tok.convert_ids_to_tokens(t) for t in stops]
    want = first_stops(free["response_ids"], free["response_mask"], stops)
    assert min(want) < 12
    for engine in ("hf", "continuous"):
        _, out = samples(engine, stop_token_list=";".join(texts))
        assert out["response_mask"].sum(-1).long().tolist() == want
        for row, n in enumerate(want):
            assert torch.equal(out["response_ids"][row, :n], free["response_ids"][row, :n])
            assert out["response"][row] == tok.decode(free["response_ids"][row, :n], skip_special_tokens=True)
        # finished: the rows that stopped (at a stop token, or EOS) within the round's 12 tokens
        assert out["rollout_finished"] == [int(out["response_ids"][row, n - 1]) in (tok.eos_token_id, *stops)
                                           for row, n in enumerate(want)]
        assert 0 < sum(out["rollout_finished"]) < 8


def engine_problems(*overrides: str, config: str = DEFAULT) -> list[str]:
    try:
        load_config(config, overrides, [EngineChecks()])
    except ConfigError as exc:
        return exc.problems
    return []


def test_sglang_is_a_known_name_refused_vllms_limits_are_named_and_a_typo_lists_the_engines():
    assert engine_problems("runtime.rollout_engine=continuous") == []
    assert engine_problems("runtime.rollout_engine=vllm") == []
    # sampling filters at temperature 1 (the default's): vLLM's raw log-probs are the trainers' (tests/test_vllm.py)
    assert engine_problems("runtime.rollout_engine=vllm", "models.policy.args_dict.top_k=5",
                           "models.policy.args_dict.top_p=0.9", "models.policy.args_dict.min_new_tokens=2") == []
    assert engine_problems("runtime.rollout_engine=vllm", "models.policy.args_dict.top_k=-1",
                           "models.policy.args_dict.temperature=0.7") == []  # vLLM's "all tokens"
    assert engine_problems("runtime.rollout_engine=vllm", "models.policy.args_dict.top_p=0.9",
                           "models.policy.args_dict.min_new_tokens=2", "models.policy.args_dict.temperature=0.7") == [
        f"models.policy.args_dict.{name} with runtime.rollout_engine 'vllm' needs temperature 1.0 "
        "(models.policy.args_dict.temperature is 0.7): vLLM gives the whole vocabulary's log-probs, what the "
        f"trainers compute, only before temperature; after it, over the tokens {name} keeps"
        for name in ("top_p", "min_new_tokens")]
    # vLLM's own settings: with another engine, or a GPU's share on the CPU build, refused by name
    assert engine_problems("runtime.rollout_engine=continuous", "models.policy.args_dict.kv_cache_space_gb=1") == [
        "models.policy.args_dict.kv_cache_space_gb is a setting of rollout_engine 'vllm'; runtime.rollout_engine "
        "is 'continuous'"]
    assert engine_problems("runtime.rollout_engine=vllm", "models.policy.args_dict.kv_cache_space_gb=1",
                           "models.policy.args_dict.max_model_len=512") == []
    if torch.version.cuda is None:
        assert engine_problems("runtime.rollout_engine=vllm", "models.policy.args_dict.gpu_memory_utilization=0.5") == [
            "models.policy.args_dict.gpu_memory_utilization is vLLM's share of a GPU's memory; this is the CPU "
            "build (torch is the CPU build): size its KV cache with kv_cache_space_gb"]
    # vLLM continues responses (tests/test_vllm.py): partial rollouts are the engine's to run
    assert not [p for p in engine_problems("runtime.rollout_engine=vllm", "runtime.use_partial_rollout=true")
                if "vllm" in p]
    assert engine_problems("runtime.rollout_engine=sglang") == [
        "runtime.rollout_engine: 'sglang' needs a GPU build of SGLang and is not supported yet; use one of "
        "['continuous', 'hf', 'vllm']"]
    assert engine_problems("runtime.rollout_engine=contineous") == [
        "runtime.rollout_engine: 'contineous' is not a rollout engine; did you mean continuous? (one of "
        "['continuous', 'hf', 'vllm'])"]


def test_pipeline_stages_generate_with_hf_only():
    problems = engine_problems("runtime.rollout_engine=continuous", "models.policy.num_cpu=2",
                               "models.policy.cpu_per_process=2", "models.policy.pipeline_model_parallel_size=2")
    assert problems == ["runtime.rollout_engine: 'continuous' with models.policy.pipeline_model_parallel_size 2 "
                        "is not supported yet (pipeline stages generate with 'hf')"]


def test_an_engine_where_no_model_generates_is_refused_not_ignored():
    assert engine_problems("runtime.rollout_engine=continuous", config=f"{REPO}/configs/dpo.yaml") == [
        "runtime.rollout_engine: 'continuous', but no model of the 'dpo' engine generates with a rollout engine "
        "(only 'hf', the default, is accepted there)"]


def test_an_engine_is_a_class_registered_by_name_and_the_check_asks_it(tiny_model_dir):
    """A new engine plugs in as one registered class: the config check accepts its name and reports what its
    `problems` says (no engine name in the check); the policy builds it and decodes with it."""
    try:
        @register_rollout_engine("greedy_only")
        class GreedyOnly(HFGenerate):
            pipeline_stages = False
            calls = 0

            @classmethod
            def problems(cls, cfg, model):
                temperature = (cfg.models[model].args_dict or {}).get("temperature", 1.0)
                return super().problems(cfg, model) + ([] if temperature == 1.0 else [
                    f"models.{model}.args_dict.temperature: {temperature}: greedy_only samples at 1.0 only"])

            def generate(self, req):
                type(self).calls += 1
                return super().generate(req)

        assert PolicyInference.rollout_engines["greedy_only"] is GreedyOnly and GreedyOnly.name == "greedy_only"
        assert engine_problems("runtime.rollout_engine=greedy_only") == []
        assert engine_problems("runtime.rollout_engine=greedy_only", "models.policy.args_dict.temperature=0.7") == [
            "models.policy.args_dict.temperature: 0.7: greedy_only samples at 1.0 only"]
        # the base class's answer: pipeline stages only for an engine that generates through them
        assert engine_problems("runtime.rollout_engine=greedy_only", "models.policy.num_cpu=2",
                               "models.policy.cpu_per_process=2", "models.policy.pipeline_model_parallel_size=2") == [
            "runtime.rollout_engine: 'greedy_only' with models.policy.pipeline_model_parallel_size 2 is not "
            "supported yet (pipeline stages generate with 'hf')"]
        policy = PolicyInference("policy")
        policy.bind(ModelConfig(num_cpu=1, args_dict={"model_path": tiny_model_dir, "max_new_tokens": 4}),
                    RuntimeConfig(rollout_engine="greedy_only"), 0, seed=7)
        policy.setup()
        batch = policy.collate_fn(policy.build_dataset(make_records(2, seed=3)))
        batch["sample_id"] = [1, 2]
        policy.forward_step(batch, iteration=0)
        assert GreedyOnly.calls == 1
        with pytest.raises(ValueError, match="does not generate through pipeline stages"):
            GreedyOnly(policy.model, stages=policy.model.generate)
        with pytest.raises(ValueError, match="'greedy_only' is already registered"):
            register_rollout_engine("greedy_only")(type("Another", (HFGenerate,), {}))
    finally:
        ROLLOUT_ENGINES.pop("greedy_only", None)


def test_an_engine_refuses_a_model_it_cannot_run_naming_the_engines_that_can(tiny_model_dir, monkeypatch):
    class NoLlama(RolloutEngine):
        @classmethod
        def model_problems(cls, model):
            return [f"the {model.config.model_type} architecture"] if model.config.model_type == "llama" else []

    monkeypatch.setitem(ROLLOUT_ENGINES, "no_llama", NoLlama)
    model = load_causal_lm(tiny_model_dir)
    assert isinstance(make_engine("continuous", model, "models.policy (tiny)"), RolloutEngine)
    with pytest.raises(ValueError) as err:
        make_engine("no_llama", model, "models.policy (tiny)")
    assert str(err.value) == ("runtime.rollout_engine: 'no_llama' does not support the llama architecture of "
                              "models.policy (tiny); use rollout_engine: continuous or hf or vllm")


def test_slot_memory_that_held_anything_does_not_reach_the_responses(biased, monkeypatch):
    """A slot's columns past its row's length are masked, but must also hold finite numbers: memory a process
    reuses can hold NaN bit patterns, and a masked NaN still makes the row NaN. Allocations that come back
    full of NaN must not change a token."""
    model, tok = biased
    req = make_request(tok, 10, do_sample=True, sample_ids=list(range(10)), seed=3, max_num_seqs=4)
    with torch.no_grad():
        want_ids, want_lp = ROLLOUT_ENGINES["continuous"](model).generate(req)
    real_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **k: real_empty(t, *a, **k).fill_(float("nan")))
    with torch.no_grad():
        got_ids, got_lp = ROLLOUT_ENGINES["continuous"](model).generate(req)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_lp, want_lp)
