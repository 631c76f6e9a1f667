"""Inference policy: sampled generation with the KV cache, plus the sampler's own log-probs."""

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field, field_validator
from transformers import LogitsProcessorList

from chatlearn.config import ModelConfig, RuntimeConfig
from chatlearn.data.records import Records
from chatlearn.models.hf.common import (
    HFModelArgs,
    HFModule,
    ensure_model_files,
    load_causal_lm,
    load_tokenizer,
    response_logprobs,
)
from chatlearn.models.hf.rollout import ROLLOUT_ENGINES, PerSampleSampler, Request, RolloutEngine, make_engine
from chatlearn.models.hf.vllm_engine import VLLMEngine  # noqa: F401  registers rollout_engine: vllm

__all__ = ["PerSampleSampler", "PolicyArgs", "PolicyInference", "response_mask_to_stop", "stop_token_ids"]


class PolicyArgs(HFModelArgs):
    max_new_tokens: int = Field(16, gt=0, description="longest response, in tokens")
    min_new_tokens: int = Field(0, ge=0, description="shortest response, in tokens: EOS and the stop tokens cannot "
                                "be drawn before (as Hugging Face's min_new_tokens and vLLM's min_tokens); "
                                "max_new_tokens on both gives fixed lengths")
    stop_token_list: list[str | int] | None = Field(
        None, description="tokens that end a response besides EOS (ChatLearn's name): a list, or one string of them "
        "split by ';' (ChatLearn's '<EOS>;</s>'); each one token of the policy's tokenizer, as its text or its id. A "
        "response keeps the stop token it ended with (trained on, as EOS is), and its text keeps the token's text "
        "unless the token is special. Stop strings of several tokens are not supported yet: each is refused by name. "
        "The EOS ids of the model's generation config stop responses too (as vLLM and Hugging Face do)")
    top_k: int = Field(0, ge=-1, description="sample from the k most likely tokens (0 or vLLM's -1: all)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    prompt_key: str = Field("prompt", description="field of a data record that holds the prompt text")
    truncate_long_prompts: bool = Field(
        False, description="a prompt longer than the model's context (max_position_embeddings) minus max_new_tokens "
        "is cut to fit, keeping its end (as TRL cuts prompts from the left); default: such a prompt is an error "
        "naming its file and line, found before anything starts")
    eval_do_sample: bool = Field(False, description="sample during eval (default greedy)")
    num_inference_per_prompt: int = Field(
        1, ge=1, description="responses sampled per prompt, kept together as a group (GRPO, online DPO); "
        "sample_per_episode and generation_batch_size count responses")
    max_num_seqs: int = Field(
        256, gt=0, description="rollout_engine: continuous and vllm: the most sequences that decode at once (vLLM's "
        "name); the prompts of a generation batch wait for a free slot beyond it")
    # vLLM's own settings (`chatlearn.models.hf.vllm_engine`), under vLLM's and ChatLearn's names; refused with
    # another engine (`RolloutEngine.own_args`)
    max_model_len: int | None = Field(
        None, gt=0, description="rollout_engine: vllm: the longest prompt plus response it takes (default the "
        "model's max_position_embeddings, at most 4,096)")
    kv_cache_space_gb: float | None = Field(
        None, gt=0, description="rollout_engine: vllm: its KV cache, in GiB (the CPU build's "
        "VLLM_CPU_KVCACHE_SPACE; default 0.25 there); on CUDA, gpu_memory_utilization by default")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="rollout_engine: vllm on CUDA: the share of the GPU's memory vLLM takes for "
        "its weights and KV cache (default 0.5, ChatLearn's); not on the CPU build: kv_cache_space_gb")
    max_num_batched_tokens: int | None = Field(
        None, gt=0, description="rollout_engine: vllm: the most tokens one scheduler step takes (default vLLM's)")

    @field_validator("top_k")
    @classmethod
    def _vllm_off(cls, value: int) -> int:
        return 0 if value == -1 else value  # vLLM's "off" is Hugging Face's 0

    @field_validator("stop_token_list", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):  # ChatLearn's form: "<EOS>;</s>"
            return [part for part in value.split(";") if part]
        return value


def stop_token_ids(tokenizer: Any, generation_config: Any, stop_token_list: list[str | int] | None,
                   where: str) -> tuple[int, ...]:
    """The ids that end a response besides the tokenizer's EOS: the generation config's other EOS ids, then each
    entry of ``stop_token_list`` (a token's text, looked up in the vocabulary, else encoded to exactly one id; or
    an id). ``where`` names the field in the ValueError for an entry that is not one token."""
    eos = getattr(generation_config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    vocab, size = tokenizer.get_vocab(), len(tokenizer)
    for entry in stop_token_list or []:
        if isinstance(entry, int):
            if not 0 <= entry < size:
                raise ValueError(f"{where}: token id {entry} is outside the tokenizer's {size} tokens")
            ids.append(entry)
            continue
        encoded = [vocab[entry]] if entry in vocab else tokenizer.encode(entry, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"{where}: {entry!r} is {len(encoded)} tokens of the policy's tokenizer ({encoded}), "
                             "not one; stop strings of several tokens are not supported yet: list single tokens")
        ids.append(encoded[0])
    return tuple(dict.fromkeys(i for i in ids if i != tokenizer.eos_token_id))


def response_mask_to_stop(response_ids: torch.Tensor, stops: int | Sequence[int]) -> torch.Tensor:
    """1 for tokens up to and including the first stop token (EOS, or any of ``stops``) of each row, 0 after it."""
    stops = torch.tensor([stops] if isinstance(stops, int) else list(stops), dtype=response_ids.dtype)
    is_stop = torch.isin(response_ids, stops.to(response_ids.device)).long()
    seen_before = is_stop.cumsum(-1) - is_stop
    return (seen_before == 0).float()


def _one_budget(budgets: list[int]) -> int:
    """A partial-rollout round's token budget: one per batch (the stage batches responses by round)."""
    if len(set(budgets)) != 1:
        raise ValueError(f"a generation batch mixes round budgets {sorted(set(budgets))}; one budget per batch")
    return int(budgets[0])


def _continued(data: dict, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts followed by the responses so far (left-padded as prompts are), and each response's length."""
    done = data["response_mask"].sum(-1).long()
    rows = [torch.cat([p[m.bool()], r[:n]]) for p, m, r, n in
            zip(data["prompt_ids"], data["prompt_mask"], data["response_ids"], done.tolist(), strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask, done


def _joined(data: dict, done: torch.Tensor, new_ids: torch.Tensor, new_logprobs: torch.Tensor | None,
            new_mask: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Each row's earlier tokens then its new ones up to its EOS (``new_mask``), right-padded; their log-probs
    likewise (the earlier rounds' from the batch: the sampler's, on the weights of their own round); the mask
    of the whole responses."""
    new_len = new_mask.sum(-1).long().tolist()
    width = max((n + k for n, k in zip(done.tolist(), new_len, strict=True)), default=0)
    ids = torch.full((len(done), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(done), width))
    lps = torch.zeros((len(done), width)) if new_logprobs is not None else None
    for i, (n, k) in enumerate(zip(done.tolist(), new_len, strict=True)):
        ids[i, :n] = data["response_ids"][i, :n]
        ids[i, n:n + k] = new_ids[i, :k].cpu()
        mask[i, :n + k] = 1
        if lps is not None:
            lps[i, :n] = data["logprobs"][i, :n]
            lps[i, n:n + k] = new_logprobs[i, :k].cpu()
    return ids, lps, mask


class PolicyInference(HFModule):
    """Generates responses for prompt batches; `forward_step` samples, `eval_step` decodes greedily."""

    supports_pipeline = True
    continues_responses = True  # partial rollouts: a batch may carry responses to go on with (`_continued`)
    # the generation backends `runtime.rollout_engine` names, by name (the config check asks the one named)
    rollout_engines = ROLLOUT_ENGINES

    args_schema = PolicyArgs

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.tokenizer = load_tokenizer(self.args.model_path)
        self.model = load_causal_lm(self.args.model_path, self.args.dtype).to(self.device).eval()
        self.parallelize()
        # the config check allowed pipeline stages only to an engine that generates through them
        self.rollout: RolloutEngine = make_engine(
            self.runtime_args.rollout_engine, self.model, f"models.{self.name} ({self.args.model_path})",
            stages=self._generate_in_stages if self.pipelined else None, args=self.args)
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.model.generation_config, self.args.stop_token_list,
                                             f"models.{self.name}.args_dict.stop_token_list")

    def process_env(self, runtime_args: RuntimeConfig) -> dict[str, str]:
        return self.rollout_engines[runtime_args.rollout_engine].process_env()

    def check_files(self, module_args: ModelConfig) -> list[str]:
        """The model files' problems, then the stop tokens' (each entry of `stop_token_list` one token of the
        tokenizer): found by the preflight, before anything starts, as one line each."""
        problems = super().check_files(module_args)
        args = self.args_schema.model_validate(module_args.args_dict or {})
        if problems or not args.stop_token_list:
            return problems
        try:
            stop_token_ids(load_tokenizer(args.model_path), None, args.stop_token_list, "args_dict.stop_token_list")
        except ValueError as exc:
            return [str(exc)]
        return []

    def weights_synced(self) -> None:
        self.rollout.weights_synced()

    def build_dataset(self, prompts, is_eval=False):
        if isinstance(prompts, Records):  # checked on the driver, and read lazily: materialised here, it would not be
            return prompts
        key = self.args.prompt_key
        for i, rec in enumerate(prompts):
            if not isinstance(rec, dict) or not isinstance(rec.get(key), str):
                raise ValueError(f"{self.name}: record {i} has no string field {key!r}: {str(rec)[:80]}")
        return list(prompts)

    def collate_fn(self, items):
        key = self.args.prompt_key
        enc = self.tokenizer([it[key] for it in items], padding=True, return_tensors="pt")
        batch = {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"]}
        for field in items[0]:
            batch[field] = [it.get(field) for it in items]
        return batch

    @torch.no_grad()
    def _generate(self, data: dict, do_sample: bool, seed: int) -> dict:
        """Responses to the batch's prompts from the rollout engine (`runtime.rollout_engine`), with the
        sampled tokens' log-probs when the per-sample sampler drew them."""
        torch.manual_seed(seed)
        prompt_ids, prompt_mask, done = data["prompt_ids"], data["prompt_mask"], None
        max_new_tokens = self.args.max_new_tokens
        if "max_generate_token_length" in data:  # a round of a partial rollout
            max_new_tokens = _one_budget(data["max_generate_token_length"])
        if "response_ids" in data:  # responses begun earlier (a partial rollout's round, a conversation's turns)
            prompt_ids, prompt_mask, done = _continued(data, self.tokenizer.pad_token_id)
        req = Request(
            prompt_ids=prompt_ids.to(self.device), prompt_mask=prompt_mask.to(self.device),
            max_new_tokens=max_new_tokens, min_new_tokens=self.args.min_new_tokens,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            stop_token_ids=self.stop_token_ids, do_sample=do_sample, sample_ids=data.get("sample_id"), seed=self.seed,
            temperature=self.args.temperature, top_k=self.args.top_k, top_p=self.args.top_p,
            max_num_seqs=self.args.max_num_seqs, first_steps=done.tolist() if done is not None else None)
        response_ids, logprobs = self.rollout.generate(req)
        mask = response_mask_to_stop(response_ids, req.stops)
        if done is not None:  # the whole response: the earlier rounds' tokens, then this round's
            response_ids, logprobs, mask = _joined(data, done, response_ids, logprobs, mask,
                                                   self.tokenizer.pad_token_id)
        pad = torch.full_like(response_ids, self.tokenizer.pad_token_id)
        response_ids = torch.where(mask.bool(), response_ids, pad)
        texts = [
            self.tokenizer.decode(ids[: int(m.sum())], skip_special_tokens=True)
            for ids, m in zip(response_ids, mask, strict=True)
        ]
        out = {**data, "response_ids": response_ids, "response_mask": mask, "response": texts}
        if logprobs is not None:
            out["logprobs"] = logprobs * mask
        if done is not None and "loss_mask" in data:  # a conversation: its observations stay out of the loss
            kept = mask.clone()
            for i, n in enumerate(done.tolist()):
                kept[i, :n] = data["loss_mask"][i, :n]
            out["loss_mask"] = kept
        if "max_generate_token_length" in data:  # partial rollouts: where each response stands
            lengths = mask.sum(-1).long()
            ended = [n > 0 and ids[n - 1] in req.stops
                     for ids, n in zip(response_ids.tolist(), lengths.tolist(), strict=True)]
            out["rollout_finished"] = [e or n >= self.args.max_new_tokens
                                       for e, n in zip(ended, lengths.tolist(), strict=True)]
            out["rollout_round"] = [r + 1 for r in data.get("rollout_round", [0] * len(texts))]
        return out

    @torch.no_grad()
    def forward_step(self, data, iteration):
        """Sampled responses and their log-probs: the sampler's, kept while drawing; a forward pass over the
        responses only where no per-sample sampler drew them (no sample ids)."""
        out = self._generate(data, do_sample=True, seed=self.seed * 1_000_003 + iteration)
        if "logprobs" not in out:
            out["logprobs"] = response_logprobs(self.infer_model, out, self.device, self.args.temperature).cpu()
        return out

    def eval_step(self, data):
        return self._generate(data, do_sample=self.args.eval_do_sample, seed=self.seed * 7_919 + 1)

    @torch.no_grad()
    def _generate_in_stages(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                            pad_token_id: int, eos_token_id: int | list[int], do_sample: bool = False,
                            logits_processor: LogitsProcessorList | None = None, min_new_tokens: int = 0,
                            **_: object) -> torch.Tensor:
        """Generation through pipeline stages, simply: every step runs the whole sequence through the stages
        (no KV cache), then picks tokens as ``generate`` does (the logits processors, argmax; finished rows
        get padding; ``eos_token_id``: every stop id, as ``generate`` takes them). Every stage calls it with the
        same batch and gets the same tokens."""
        if do_sample:
            raise NotImplementedError("pipeline-parallel generation samples through the per-sample sampler "
                                      "only (sample ids); eval_do_sample is not supported with it yet")
        ids, mask = input_ids, attention_mask
        stops = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, device=ids.device)
        unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        for step in range(max_new_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            scores = self.infer_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1, :].float()
            if step < min_new_tokens:
                scores[:, stops] = float("-inf")
            if logits_processor is not None:
                scores = logits_processor(ids, scores)
            nxt = torch.where(unfinished, scores.argmax(-1), torch.full_like(unfinished, pad_token_id,
                                                                                dtype=torch.long))
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            unfinished &= ~torch.isin(nxt, stops)
            if not unfinished.any():
                break
        return ids
