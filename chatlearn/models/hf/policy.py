"""Inference policy: sampled generation with the KV cache, plus the sampler's own log-probs."""

import torch
from pydantic import Field, field_validator
from transformers import LogitsProcessorList

from chatlearn.models.hf.common import (
    HFModelArgs,
    HFModule,
    ensure_model_files,
    load_causal_lm,
    load_tokenizer,
    response_logprobs,
)


class PolicyArgs(HFModelArgs):
    max_new_tokens: int = Field(16, gt=0, description="longest response, in tokens")
    min_new_tokens: int = Field(0, ge=0, description="shortest response, in tokens: EOS cannot be drawn before "
                                "(as Hugging Face's min_new_tokens); max_new_tokens on both gives fixed lengths")
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

    @field_validator("top_k")
    @classmethod
    def _vllm_off(cls, value: int) -> int:
        return 0 if value == -1 else value  # vLLM's "off" is Hugging Face's 0


class PerSampleSampler:
    """A logits processor that makes greedy decoding sample, with one random stream per sample.

    Gumbel-max: argmax(logits / T + Gumbel noise) is an exact draw from softmax(logits / T). The noise of row
    i at step t (the t-th response token) comes from a generator seeded by (seed, sample_id[i], t), so a
    sample's response does not depend on which batch, batch size or replica generated it, nor on how much the
    batch padded its prompt; a resumed run and a run with another `generation_batch_size` draw the same
    responses. `prompt_width` is the batch's padded prompt length (where the response starts in `input_ids`).

    It also keeps the sampled tokens' log-probs, log_softmax(logits / T) over the whole vocabulary (what the
    trainers compute: no top-k/top-p, no EOS ban), so generation needs no second forward pass for them
    (`logprobs()`). That needs the model's own logits: `min_new_tokens` is applied here, after they are read,
    not by Hugging Face's processor (which would run before this one and hide EOS's logit).
    """

    def __init__(self, seed: int, sample_ids: list[int], temperature: float, top_k: int, top_p: float,
                 prompt_width: int = 0, min_new_tokens: int = 0, eos_token_id: int | None = None):
        self.seed, self.sample_ids = seed, list(sample_ids)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.prompt_width = prompt_width
        self.min_new_tokens, self.eos_token_id = min_new_tokens, eos_token_id
        self._logprobs: list[torch.Tensor] = []

    def logprobs(self, length: int) -> torch.Tensor:
        """[B, length] log-probs of the tokens drawn at the first `length` steps (rows that had finished hold
        the log-prob of a token generation replaced by padding: masked downstream)."""
        if length > len(self._logprobs):
            raise RuntimeError(f"the sampler saw {len(self._logprobs)} steps, not {length}")
        if length == 0:
            return torch.zeros(len(self.sample_ids), 0)
        return torch.stack(self._logprobs[:length], 1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        scores = scores.float() / self.temperature
        full = scores.log_softmax(-1)
        if self.eos_token_id is not None and step < self.min_new_tokens:
            scores = scores.clone()
            scores[:, self.eos_token_id] = float("-inf")
        vocab = scores.shape[-1]
        if 0 < self.top_k < vocab:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop = cum - sorted_scores.softmax(-1) >= self.top_p  # keep the smallest prefix reaching top_p
            scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        noise = torch.empty_like(scores)
        for row, sid in enumerate(self.sample_ids):
            gen = torch.Generator(device="cpu").manual_seed((self.seed * 1_000_003 + sid) * 65_537 + step)
            u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
            noise[row] = (-torch.log(-torch.log(u))).to(noise.device, noise.dtype)
        out = scores + noise
        # greedy decoding takes the argmax of what this returns: that token's log-prob, unbanned and unclipped
        if len(self._logprobs) == step:
            self._logprobs.append(full.gather(-1, out.argmax(-1, keepdim=True)).squeeze(-1).cpu())
        return out


def response_mask_from_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 for tokens up to and including the first EOS of each row, 0 after it."""
    is_eos = (response_ids == eos_token_id).long()
    seen_before = is_eos.cumsum(-1) - is_eos
    return (seen_before == 0).float()


class PolicyInference(HFModule):
    """Generates responses for prompt batches; `forward_step` samples, `eval_step` decodes greedily."""

    supports_pipeline = True

    args_schema = PolicyArgs

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.tokenizer = load_tokenizer(self.args.model_path)
        self.model = load_causal_lm(self.args.model_path, self.args.dtype).to(self.device).eval()
        self.parallelize()

    def build_dataset(self, prompts, is_eval=False):
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
        torch.manual_seed(seed)
        prompt_ids = data["prompt_ids"].to(self.device)
        prompt_mask = data["prompt_mask"].to(self.device)
        sampler = None
        min_new_tokens = self.args.min_new_tokens
        if do_sample and data.get("sample_id") is not None:
            sampler = PerSampleSampler(self.seed, data["sample_id"], self.args.temperature, self.args.top_k,
                                       self.args.top_p, prompt_width=prompt_ids.shape[1],
                                       min_new_tokens=min_new_tokens, eos_token_id=self.tokenizer.eos_token_id)
            kwargs = dict(do_sample=False, logits_processor=LogitsProcessorList([sampler]))
            min_new_tokens = 0  # the sampler bans EOS itself, after reading its logit
        elif do_sample:
            kwargs = dict(do_sample=True, temperature=self.args.temperature, top_k=self.args.top_k,
                          top_p=self.args.top_p)
        else:
            kwargs = dict(do_sample=False)
        generate = self._generate_in_stages if self.pipelined else self.model.generate
        out = generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=self.args.max_new_tokens,
            min_new_tokens=min_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            use_cache=True,
            **kwargs,
        ).cpu()
        response_ids = out[:, prompt_ids.shape[1] :]
        mask = response_mask_from_eos(response_ids, self.tokenizer.eos_token_id)
        pad = torch.full_like(response_ids, self.tokenizer.pad_token_id)
        response_ids = torch.where(mask.bool(), response_ids, pad)
        texts = [
            self.tokenizer.decode(ids[: int(m.sum())], skip_special_tokens=True)
            for ids, m in zip(response_ids, mask, strict=True)
        ]
        out = {**data, "response_ids": response_ids, "response_mask": mask, "response": texts}
        if sampler is not None:
            out["logprobs"] = sampler.logprobs(response_ids.shape[1]) * mask
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
                            pad_token_id: int, eos_token_id: int, do_sample: bool = False,
                            logits_processor: LogitsProcessorList | None = None, min_new_tokens: int = 0,
                            **_: object) -> torch.Tensor:
        """Generation through pipeline stages, simply: every step runs the whole sequence through the stages
        (no KV cache), then picks tokens as ``generate`` does (the logits processors, argmax; finished rows
        get padding). Every stage calls it with the same batch and gets the same tokens."""
        if do_sample:
            raise NotImplementedError("pipeline-parallel generation samples through the per-sample sampler "
                                      "only (sample ids); eval_do_sample is not supported with it yet")
        ids, mask = input_ids, attention_mask
        unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        for step in range(max_new_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            scores = self.infer_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1, :].float()
            if step < min_new_tokens:
                scores[:, eos_token_id] = float("-inf")
            if logits_processor is not None:
                scores = logits_processor(ids, scores)
            nxt = torch.where(unfinished, scores.argmax(-1), torch.full_like(unfinished, pad_token_id,
                                                                                dtype=torch.long))
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            unfinished &= nxt != eos_token_id
            if not unfinished.any():
                break
        return ids
