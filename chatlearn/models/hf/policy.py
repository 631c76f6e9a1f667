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
from chatlearn.models.hf.rollout import (
    GPU_ONLY_ROLLOUT_ENGINES,
    ROLLOUT_ENGINES,
    PerSampleSampler,
    Request,
    hf_generate,
)

__all__ = ["PerSampleSampler", "PolicyArgs", "PolicyInference", "response_mask_from_eos"]


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
    max_num_seqs: int = Field(
        256, gt=0, description="rollout_engine: continuous: the most sequences that decode at once (vLLM's "
        "name); the prompts of a generation batch wait for a free slot beyond it")

    @field_validator("top_k")
    @classmethod
    def _vllm_off(cls, value: int) -> int:
        return 0 if value == -1 else value  # vLLM's "off" is Hugging Face's 0


def response_mask_from_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 for tokens up to and including the first EOS of each row, 0 after it."""
    is_eos = (response_ids == eos_token_id).long()
    seen_before = is_eos.cumsum(-1) - is_eos
    return (seen_before == 0).float()


class PolicyInference(HFModule):
    """Generates responses for prompt batches; `forward_step` samples, `eval_step` decodes greedily."""

    supports_pipeline = True
    # the generation backends `runtime.rollout_engine` names (the config check reads them here)
    rollout_engines = ROLLOUT_ENGINES
    gpu_only_rollout_engines = GPU_ONLY_ROLLOUT_ENGINES

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
        """Responses to the batch's prompts from the rollout engine (`runtime.rollout_engine`), with the
        sampled tokens' log-probs when the per-sample sampler drew them."""
        torch.manual_seed(seed)
        req = Request(
            prompt_ids=data["prompt_ids"].to(self.device), prompt_mask=data["prompt_mask"].to(self.device),
            max_new_tokens=self.args.max_new_tokens, min_new_tokens=self.args.min_new_tokens,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            do_sample=do_sample, sample_ids=data.get("sample_id"), seed=self.seed,
            temperature=self.args.temperature, top_k=self.args.top_k, top_p=self.args.top_p,
            max_num_seqs=self.args.max_num_seqs)
        if self.pipelined:  # the config check allows only hf here: its loop runs through the stages
            response_ids, logprobs = hf_generate(self.model, req, generate=self._generate_in_stages)
        else:
            response_ids, logprobs = ROLLOUT_ENGINES[self.runtime_args.rollout_engine](self.model, req)
        mask = response_mask_from_eos(response_ids, self.tokenizer.eos_token_id)
        pad = torch.full_like(response_ids, self.tokenizer.pad_token_id)
        response_ids = torch.where(mask.bool(), response_ids, pad)
        texts = [
            self.tokenizer.decode(ids[: int(m.sum())], skip_special_tokens=True)
            for ids, m in zip(response_ids, mask, strict=True)
        ]
        out = {**data, "response_ids": response_ids, "response_mask": mask, "response": texts}
        if logprobs is not None:
            out["logprobs"] = logprobs * mask
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
