"""Shared pieces of the built-in Hugging Face modules: loading, and the token-level forward passes.

Prompts are left-padded and responses right-padded (see `chatlearn.data.batch`). Position ids are derived
from the attention mask so a padded prompt sees the same positions it would unpadded, in generation and in
scoring alike; otherwise the trainer's log-probs would not match the sampler's. With ``models.<name>.packing``
the same forwards run padding-free (:mod:`chatlearn.models.hf.packing`) and give the losses the same [B, R]
per-token values (:class:`ResponseTokens`).
"""

import json
import os
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from transformers import AutoModelForCausalLM, AutoTokenizer

from chatlearn.algorithms import logprobs_from_logits
from chatlearn.algorithms.grpo import entropy_from_logits
from chatlearn.config import ModelConfig
from chatlearn.config.errors import did_you_mean
from chatlearn.models.hf.packing import Packed, pack, row_chunks, rows, use_packed_attention
from chatlearn.models.hf.tiny import TinyModelSpec, ensure_tiny_model
from chatlearn.models.precision import autocast_bf16
from chatlearn.models.torch_module import TorchModule


class HFModelArgs(BaseModel):
    """Arguments shared by the built-in modules (`models.<name>.args_dict`)."""

    model_config = ConfigDict(extra="allow")

    module: str | None = Field(None, description="module class as 'package.module:Class' (built-in default by name)")
    model_path: str | None = Field(None, description="local Hugging Face model directory to load")
    tiny_model_path: str | None = Field(
        None, description="where the embedded tiny model may be built: when model_path names this directory and "
        "it holds no model yet, a random-init tiny model (spec: tiny_model) is built there first. The one switch "
        "that builds it; any other model_path that does not exist is an error naming it (a typo is never "
        "silently filled with a random model)"
    )
    tiny_model: dict | None = Field(
        None, description="spec of the tiny model built at tiny_model_path (chatlearn.models.hf.tiny.TinyModelSpec "
        "fields, e.g. architecture: llama (default), qwen2, qwen3 or mistral; default: its defaults)"
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature (also used for log-probs)")
    dtype: str = Field("float32", description="torch dtype of the weights")
    bf16: bool = Field(
        False, description="bf16 mixed precision (ChatLearn's field): a trainer keeps fp32 weights and optimizer "
        "state and runs its decoder layers and LM head in bf16 (autocast), with log-probs, KL and losses in fp32; "
        "an inference model holds bf16 weights, and the sync sends it bf16 (chatlearn.models.precision)")

    @field_validator("dtype")
    @classmethod
    def _torch_float(cls, name: str) -> str:
        # checked with the config: the model loads it as getattr(torch, dtype) in its actor's setup
        found = getattr(torch, name, None) if isinstance(name, str) else None
        if not (isinstance(found, torch.dtype) and found.is_floating_point):
            known = ("bfloat16", "float16", "float32", "float64")
            raise ValueError(f"{name!r} is not a torch floating-point dtype{did_you_mean(name, known)} (one of "
                             f"{', '.join(known)})")
        return name

    @model_validator(mode="after")
    def _bf16_keeps_fp32_weights(self) -> "HFModelArgs":
        if self.bf16 and self.dtype != "float32":
            raise ValueError(f"bf16: true keeps fp32 weights (a trainer's master copy; an inference copy is cast "
                             f"to bf16 itself), so dtype must stay float32, got {self.dtype!r}; dtype: bfloat16 "
                             "alone gives pure bf16 weights")
        return self


def load_tokenizer(path: str):
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(path: str, dtype: str = "float32") -> torch.nn.Module:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))


def sliding_window(model: torch.nn.Module) -> int | None:
    """The attention window of ``model`` (Mistral's ``sliding_window``: each token sees that many positions), or
    None when its attention is not windowed (Qwen2/Qwen3 keep a ``sliding_window`` that only acts with
    ``use_sliding_window``; their configs then hold None)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "backbone", None), "config", None)
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window) if window else None


def full_sequence(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and position_ids for prompt+response."""
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"].long(), batch["response_mask"].long()], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attn, pos


def _response_positions(model, batch: dict, device: torch.device):
    """Run `model` on prompt+response; returns (output, slice of the positions that emit response tokens).
    `model` is the model or anything called like it (a DDP wrapper, a pipeline of stages)."""
    input_ids, attn, pos = full_sequence(batch)
    out = model(input_ids=input_ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device))
    return out, response_span(batch)


def response_span(batch: dict) -> slice:
    """The positions of prompt+response logits that predict the response tokens."""
    p = batch["prompt_ids"].shape[1]
    return slice(p - 1, p - 1 + batch["response_ids"].shape[1])


def response_logits(model, batch: dict, device: torch.device) -> torch.Tensor:
    """Logits [B, R, V] that predict each response token. The LM head runs on those positions only (Hugging
    Face's ``logits_to_keep``): the prompt's positions predict nothing that is scored, and over a vocabulary
    of 150k their logits would cost more than the layers. The positions go as an index tensor, not a count:
    a count slices the hidden states into a strided view, on which the head's matmul takes another kernel
    when its weight requires grad, and the trainer's log-probs would then differ from the reference's in
    the last bits at identical weights; an index gathers a contiguous copy, and both agree exactly."""
    input_ids, attn, pos = full_sequence(batch)
    span = response_span(batch)
    keep = torch.arange(span.start, span.stop, device=device)
    out = model(input_ids=input_ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                logits_to_keep=keep)
    return out.logits


def logprobs_of(logits: torch.Tensor, batch: dict, device: torch.device, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, R] of the response tokens from their logits [B, R, V] (0 at padding)."""
    lp = logprobs_from_logits(logits, batch["response_ids"].to(device), temperature)
    return lp * batch["response_mask"].to(device)


class ResponseTokens(NamedTuple):
    """What a loss reads of a forward pass: per response token, [B, R], 0 at padding. ``entropy`` (of
    ``softmax(logits / temperature)``) only when asked for. Padded or packed, the losses see the same."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


def tokens_of(logits: torch.Tensor, batch: dict, device: torch.device, temperature: float = 1.0,
              entropy: bool = False) -> ResponseTokens:
    """:class:`ResponseTokens` from the logits [B, R, V] that predict the response tokens (the padded path)."""
    ent = None
    if entropy:
        ent = entropy_from_logits(logits.float() / temperature) * batch["response_mask"].to(device)
    return ResponseTokens(logprobs_of(logits, batch, device, temperature), ent)


def packed_tokens_of(model, views: Sequence[dict], device: torch.device, temperature: float = 1.0,
                     entropy: bool = False) -> list[ResponseTokens]:
    """:class:`ResponseTokens` of each view (a batch; DPO's chosen and rejected sides) from ONE forward over
    their sequences packed into a row (:mod:`chatlearn.models.hf.packing`): no pad token is computed, and the
    LM head runs on the N response-predicting positions only ([N, V] logits, never [B, R, V])."""
    p = pack(views, device)
    logits = model(input_ids=p.input_ids, position_ids=p.position_ids, logits_to_keep=p.keep,
                   use_cache=False).logits  # without use_cache=False, transformers' masks ignore the packing
    return packed_tokens_from(logits[0], p, temperature, entropy)


def packed_tokens_from(logits: torch.Tensor, p: Packed, temperature: float = 1.0,
                       entropy: bool = False) -> list[ResponseTokens]:
    """:class:`ResponseTokens` of each view of the packing ``p`` from the logits [N, V] at its ``keep``
    positions (the LM head's output there; a pipeline's last stage gathers them from the whole row)."""
    lp = logprobs_from_logits(logits[None], p.labels[None], temperature)[0]
    parts = p.unpack(lp)
    ents = p.unpack(entropy_from_logits(logits.float() / temperature)) if entropy else [None] * len(parts)
    return [ResponseTokens(lp, ent) for lp, ent in zip(parts, ents, strict=True)]


def response_tokens(model, batch: dict, device: torch.device, temperature: float = 1.0, entropy: bool = False,
                    packed: bool = False, budget: int | None = None) -> ResponseTokens:
    """:class:`ResponseTokens` of ``batch`` under ``model``: padded (logits at the response positions), or
    ``packed``, in forwards of at most ``budget`` tokens each (rows cut in order; one forward when None)."""
    if not packed:
        return tokens_of(response_logits(model, batch, device), batch, device, temperature, entropy)
    parts = [packed_tokens_of(model, [rows(batch, c)], device, temperature, entropy)[0]
             for c in ([slice(None)] if budget is None else row_chunks(batch, budget))]
    if len(parts) == 1:
        return parts[0]
    return ResponseTokens(torch.cat([t.logprobs for t in parts]),
                          torch.cat([t.entropy for t in parts]) if entropy else None)


def response_logprobs(model, batch: dict, device: torch.device, temperature: float = 1.0, *, packed: bool = False,
                      budget: int | None = None) -> torch.Tensor:
    """Log-probs [B, R] of the response tokens under `model` (0 at padding); ``packed``: see
    :func:`response_tokens`."""
    return response_tokens(model, batch, device, temperature, packed=packed, budget=budget).logprobs


def widen(batches: list[dict], pad_id: int) -> list[dict]:
    """The micro-batches padded to one prompt width (left) and one response width (right), every prompt-side
    (``prompt_*``) and response-side ([B, R] tensor) field alike, so a pipeline schedule can stack them.
    Padding is masked, so every real token sees what it saw before."""
    p = max(b["prompt_ids"].shape[1] for b in batches)
    r = max(b["response_ids"].shape[1] for b in batches)
    out = []
    for b in batches:
        bp, br = b["prompt_ids"].shape[1], b["response_ids"].shape[1]
        w = dict(b)
        for k, v in b.items():
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                continue
            if k.startswith("prompt_") and bp < p:
                fill = pad_id if k == "prompt_ids" else 0
                w[k] = torch.cat([torch.full((v.shape[0], p - bp, *v.shape[2:]), fill, dtype=v.dtype), v], 1)
            elif not k.startswith("prompt_") and v.shape[1] == br and br < r:
                fill = pad_id if k.endswith("_ids") else 0
                w[k] = torch.cat([v, torch.full((v.shape[0], r - br, *v.shape[2:]), fill, dtype=v.dtype)], 1)
        out.append(w)
    return out


def response_hidden_states(backbone: torch.nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    """Last hidden states [B, R, H] of the positions that emit each response token."""
    out, span = _response_positions(backbone, batch, device)
    return out.last_hidden_state[:, span, :]


def packed_hidden_states(backbone: torch.nn.Module, batch: dict, device: torch.device) -> tuple[torch.Tensor, Packed]:
    """Last hidden states [N, H] of the positions that emit each real response token, from one forward over
    ``batch``'s sequences packed into a row, and the packing (``unpack`` puts per-token values back to [B, R])."""
    p = pack([batch], device)
    out = backbone(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False)
    return out.last_hidden_state[0, p.keep], p


def builds_tiny_model(args: HFModelArgs) -> bool:
    """Whether `model_path` is where the config asks for the embedded tiny model (`tiny_model_path`).

    The build is tied to that one path, not to `tiny_model` alone: the default config gives every model the
    spec (configs/tiny_llama.yaml), so a `model_path` override with a typo would otherwise get a random model.
    """
    if not args.model_path or not args.tiny_model_path:
        return False
    return os.path.realpath(os.path.expanduser(args.model_path)) == os.path.realpath(
        os.path.expanduser(args.tiny_model_path))


def ensure_model_files(args: HFModelArgs) -> None:
    """Build the embedded tiny model when the config asks for it and it is not there yet."""
    if builds_tiny_model(args):
        ensure_tiny_model(args.model_path, args.tiny_model)


def model_path_problems(args: HFModelArgs, owner: str) -> list[str]:
    """What is wrong with `model_path`, as ``"args_dict.<field>: ..."`` lines (none: it can be loaded).

    Checked on the driver before anything starts, so a typo is one line naming the field and the path rather
    than a Hugging Face traceback from every actor after Ray and Prefect came up. The embedded tiny model is
    built here, and only at `tiny_model_path` (:func:`builds_tiny_model`): a missing path is never silently
    filled with a random model. `owner` names the module class in the message.
    """
    field = "args_dict.model_path"
    path = args.model_path
    if not path:
        return [f"{field}: required: the local Hugging Face model directory {owner} loads"]
    shown = repr(path) if os.path.isabs(path) else f"{path!r} ({os.path.abspath(path)})"
    if builds_tiny_model(args):
        try:
            TinyModelSpec.model_validate(args.tiny_model or {})
        except ValidationError as exc:
            return [f"args_dict.tiny_model.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                    for e in exc.errors(include_url=False)]
        try:
            ensure_tiny_model(path, args.tiny_model)
        except (ValueError, OSError) as exc:
            return [f"{field}: cannot build the tiny model at {shown}: {exc}"]
        return []
    if not os.path.exists(path):
        return [f"{field}: {shown} does not exist (a local Hugging Face model directory; the embedded tiny "
                "Llama is built only where model_path is args_dict.tiny_model_path)"]
    if not os.path.isdir(path):
        return [f"{field}: {shown} is not a directory (a local Hugging Face model directory)"]
    if not os.path.isfile(os.path.join(path, "config.json")):
        return [f"{field}: {shown} has no config.json: not a Hugging Face model directory"]
    return []


def tensor_parallel_problems(args: HFModelArgs, module_args: ModelConfig) -> list[str]:
    """``tensor_model_parallel_size`` against the heads of the model at ``model_path`` (read from its
    config.json): tensor parallel splits the attention by whole heads, so the size must divide the query heads
    and the key/value heads (a rank holding half a head fails in the attention's reshape, or computes another
    model)."""
    tp = int(getattr(module_args, "tensor_model_parallel_size", 1) or 1)
    if tp <= 1 or not args.model_path:
        return []
    try:
        with open(os.path.join(args.model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return []  # model_path_problems said what is wrong with the directory
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    problems = []
    for field, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(count, int) and count % tp:
            problems.append(f"tensor_model_parallel_size: {tp} does not divide the {count} {field} of "
                            f"{args.model_path!r} (tensor parallel gives each rank whole heads); use a divisor of "
                            f"{count}")
    return problems


class HFModule(TorchModule):
    """A built-in module on a Hugging Face model at `args_dict.model_path` (built first when it is the
    embedded tiny model)."""

    args_schema = HFModelArgs
    # a replica may span processes: data parallel and ZeRO (trainers), tensor parallel (see TorchModule)
    multi_process = True
    # whether it scores / trains on packed sequences when `models.<name>.packing` is on (the config refuses
    # packing for a module without it, see chatlearn.config.engine_checks)
    supports_packing: ClassVar[bool] = False

    @property
    def packing(self) -> bool:
        """``models.<name>.packing``: padding-free forwards (:mod:`chatlearn.models.hf.packing`)."""
        return bool(getattr(self.module_args, "packing", False))

    @property
    def packing_budget(self) -> int:
        """``models.<name>.max_token_in_packing``: the most tokens one packed forward (micro-batch) holds."""
        return int(getattr(self.module_args, "max_token_in_packing", 32768))

    def parallelize(self) -> None:
        if getattr(self.args, "bf16", False):  # before any wrapper (DDP, FSDP2, TP) captures the parameters
            if self.trainable:
                autocast_bf16(self.model, self.device.type)
            else:  # a value network's head stays fp32: it reads the backbone's states upcast
                getattr(self.model, "backbone", self.model).to(torch.bfloat16)
        if self.packing:  # the attention that keeps packed sequences apart (padded calls are SDPA's, exactly)
            if (window := sliding_window(self.model)) is not None:
                raise ValueError(
                    f"models.{self.name}.packing: true is not supported for a sliding-window model "
                    f"({self.args.model_path}: sliding_window {window}): the packed attention is full causal "
                    "attention; set packing: false")
            use_packed_attention(self.model)
        super().parallelize()

    def prepare_files(self, module_args: ModelConfig) -> None:
        ensure_model_files(self.args_schema.model_validate(module_args.args_dict or {}))

    def check_files(self, module_args: ModelConfig) -> list[str]:
        """Problems with the model files the config names (``"args_dict.<field>: ..."``), found by the preflight
        (`chatlearn.data.preflight`) before any Prefect or Ray resource exists; builds the tiny model where the
        config asks for it, as `prepare_files` does."""
        args = self.args_schema.model_validate(module_args.args_dict or {})
        return model_path_problems(args, type(self).__name__) or tensor_parallel_problems(args, module_args)
