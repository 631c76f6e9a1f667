"""Rollout engines: how the inference policy turns a batch of prompts into responses (`runtime.rollout_engine`).

An engine is a :class:`RolloutEngine` subclass registered by name (:func:`register_rollout_engine`). The policy
makes one in its setup with its Hugging Face model (:func:`make_engine`) and calls it for every generation batch:

* it gets the model (``cls(model, stages=None)``; ``stages``: the pipeline stages' generate loop, called like
  ``model.generate``, only for an engine that declares ``pipeline_stages``) and a :class:`Request` per batch
  (left-padded prompt ids and mask, the token budget, the stop ids (EOS and the others, ``Request.stops``), the
  pad id, and how to pick tokens);
* it returns ``generate(request) -> (response_ids, logprobs)``: the response ids ``[B, R]`` (R: the longest
  response; a row ends at its first stop token, which it keeps; what follows is padding the policy masks) and
  the sampled tokens' log-probs ``[B, R]`` (None when the per-sample sampler did not draw them: the policy then
  scores the responses itself);
* it declares, for the config check (`chatlearn.config.engine_checks`, which knows no engine by name and asks
  the class): ``problems(cfg, model)``, why it cannot generate for ``models.<model>`` of that config (one line
  each, naming the field; the base refuses pipeline stages unless ``pipeline_stages``), and for the loaded model
  ``model_problems(model)``, what of it the engine cannot run (checked in the policy's setup).

The engines:

* ``hf``: one Hugging Face ``generate`` over the batch. Every row runs until the longest response ends (a
  finished row keeps computing padding), so a batch with one long response pays for it in every row.
* ``continuous``: continuous batching on the dense KV cache. At most ``max_num_seqs`` sequences decode at
  once; a sequence that ends leaves the batch at once (its cache rows are dropped) and a waiting prompt takes
  its slot (prefilled, then left-padded into the running cache). Decode steps cost what the live rows cost.

Both draw tokens with the same per-sample sampler (:func:`perturb`): the noise of a token depends on the run
seed, the sample id and the token's index in its response only, so a sample gets the same response whatever
engine, batch or slot it ran in (up to the last bits of the logits, which depend on the batch's shapes).
Both return the sampled tokens' log-probs, read from the model's logits as the tokens are drawn.

``vllm`` (vLLM in the policy's process) is `chatlearn.models.hf.vllm_engine`. ``sglang`` is registered as a
:class:`NotSupportedYet` entry: a known name whose ``problems`` refuse it (it needs a GPU build).
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, LogitsProcessorList
from transformers.cache_utils import Cache, CacheLayerMixin

from chatlearn.config.root import ChatLearnConfig
from chatlearn.models.hf.common import sliding_window

__all__ = ["ROLLOUT_ENGINES", "ContinuousBatching", "HFGenerate", "NotSupportedYet", "PerSampleSampler", "Request",
           "RolloutEngine", "make_engine", "register_rollout_engine", "runnable_engines"]

ROLLOUT_ENGINES: dict[str, type["RolloutEngine"]] = {}


def register_rollout_engine(name: str) -> Callable[[type["RolloutEngine"]], type["RolloutEngine"]]:
    """Class decorator: register a :class:`RolloutEngine` subclass as ``runtime.rollout_engine: name``."""
    def decorator(cls: type["RolloutEngine"]) -> type["RolloutEngine"]:
        if ROLLOUT_ENGINES.get(name, cls) is not cls:
            raise ValueError(f"rollout engine {name!r} is already registered")
        cls.name = name
        ROLLOUT_ENGINES[name] = cls
        return cls
    return decorator


def runnable_engines(model: Any = None) -> list[str]:
    """The registered engines that generate (not the names registered only to be refused), sorted; with a loaded
    ``model``, those that can run it."""
    return sorted(name for name, cls in ROLLOUT_ENGINES.items()
                  if cls.implemented and (model is None or not cls.model_problems(model)))


def make_engine(name: str, model: Any, where: str, stages: Callable[..., torch.Tensor] | None = None,
                args: Any = None) -> "RolloutEngine":
    """The engine ``name`` for the loaded ``model`` (``where`` names it: ``models.policy (path)``), with the
    policy's args (``args``: what the engine's `own_args` fields say; None: their defaults); a ValueError
    naming the field, what the engine cannot run and the engines that can, when it cannot."""
    cls = ROLLOUT_ENGINES[name]
    unsupported = cls.model_problems(model)
    if unsupported:
        raise ValueError(f"runtime.rollout_engine: {name!r} does not support {'; '.join(unsupported)} of {where}; "
                         f"use rollout_engine: {' or '.join(runnable_engines(model))}")
    return cls(model, stages=stages, args=args, where=where)


@dataclass
class Request:
    """One generate call: left-padded prompts, and how to pick tokens.

    ``sample_ids`` set and ``do_sample``: the per-sample sampler draws (seeded by ``seed``). ``do_sample``
    without sample ids: Hugging Face's own sampling (``hf`` only). Otherwise greedy."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    max_new_tokens: int
    min_new_tokens: int
    eos_token_id: int
    pad_token_id: int
    # tokens that end a response besides EOS (the policy's `stop_token_list`, the generation config's other EOS ids)
    stop_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    sample_ids: list[int] | None = None
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_num_seqs: int = 256
    # a continued response (partial rollouts): each row's tokens so far are the end of its prompt, and its new
    # tokens are response steps first_steps[i], first_steps[i] + 1, ... (the sampler's noise, the stop tokens' ban)
    first_steps: list[int] | None = None

    @property
    def stops(self) -> tuple[int, ...]:
        """Every token that ends a response (kept as its last token), EOS first; none can be drawn before
        ``min_new_tokens``."""
        return (self.eos_token_id, *(t for t in self.stop_token_ids if t != self.eos_token_id))


class RolloutEngine:
    """How the policy generates (the module docstring says what an engine gets, returns and declares)."""

    name: ClassVar[str] = ""  # set by register_rollout_engine
    implemented: ClassVar[bool] = True  # False: a known name the config check refuses (NotSupportedYet)
    pipeline_stages: ClassVar[bool] = False  # generates through pipeline stages (is given their ``stages`` loop)
    # the policy's args only this engine reads (None: unset); set with another engine, the config check refuses them
    own_args: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: Any, stages: Callable[..., torch.Tensor] | None = None, args: Any = None,
                 where: str = "") -> None:
        """``args``: the policy's (an engine reads its `own_args` there; None: their defaults); ``where`` names
        the policy in errors."""
        if stages is not None and not self.pipeline_stages:
            raise ValueError(f"rollout engine {self.name!r} does not generate through pipeline stages")
        self.model, self.stages = model, stages

    @classmethod
    def problems(cls, cfg: ChatLearnConfig, model: str) -> list[str]:
        """Why this engine cannot generate for ``models.<model>`` of ``cfg``: one line each, naming the field."""
        pp = cfg.models[model].pipeline_model_parallel_size or 1
        if pp > 1 and not cls.pipeline_stages:
            stages = " or ".join(repr(n) for n, e in sorted(ROLLOUT_ENGINES.items())
                                 if e.pipeline_stages and e.implemented)
            return [f"runtime.rollout_engine: {cls.name!r} with models.{model}.pipeline_model_parallel_size {pp} "
                    f"is not supported yet (pipeline stages generate with {stages})"]
        args = cfg.models[model].args_dict or {}
        return [f"models.{model}.args_dict.{field} is a setting of rollout_engine {other.name!r}; "
                f"runtime.rollout_engine is {cls.name!r}"
                for other in sorted(ROLLOUT_ENGINES.values(), key=lambda e: e.name) if other is not cls
                for field in other.own_args if field not in cls.own_args and args.get(field) is not None]

    @classmethod
    def process_env(cls) -> dict[str, str]:
        """Environment variables the policy's process must start with to run this engine (a library preloaded);
        the driver starts the process with them. None by default."""
        return {}

    @classmethod
    def model_problems(cls, model: Any) -> list[str]:
        """What of the loaded ``model`` this engine cannot run (e.g. "the sliding-window attention
        (sliding_window 8)"); the policy's setup refuses the model with it, naming the model."""
        return []

    def generate(self, req: "Request") -> tuple[torch.Tensor, torch.Tensor | None]:
        """The response ids [B, R] and the sampled tokens' log-probs [B, R] (None: not drawn per sample)."""
        raise NotImplementedError(f"{type(self).__name__}.generate")

    def weights_synced(self) -> None:
        """The sync stage just wrote the policy's weights: an engine with a copy of its own takes them now, so
        the time counts as the sync's (the engines that decode with the policy's own model have nothing to do)."""


class NotSupportedYet(RolloutEngine):
    """A name ChatLearn knows whose engine needs what this build has not (``needs``): refused by the config
    check with that reason and the engines that run."""

    implemented = False
    needs: ClassVar[str] = ""

    @classmethod
    def problems(cls, cfg: ChatLearnConfig, model: str) -> list[str]:
        return [f"runtime.rollout_engine: {cls.name!r} needs {cls.needs} and is not supported yet; use one of "
                f"{runnable_engines()}"]

    def generate(self, req: "Request") -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError(f"rollout engine {self.name!r} needs {self.needs}")


@register_rollout_engine("sglang")
class SGLangNotYet(NotSupportedYet):
    needs = "a GPU build of SGLang"


def kv_cache_argument(model: Any) -> str:
    """The name of the KV cache in ``model``'s forward and output: ``cache`` from transformers 5.2x,
    ``past_key_values`` before (5.19, which vLLM 0.32 needs)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def ban_stops(scores: torch.Tensor, steps: list[int], min_new_tokens: int, stops: tuple[int, ...]) -> torch.Tensor:
    """``scores`` with the stop tokens at -inf in the rows whose response step is before ``min_new_tokens`` (a
    copy when any row is banned: the caller's scores stay as they were)."""
    if not stops or not min_new_tokens:
        return scores
    banned = torch.tensor([s < min_new_tokens for s in steps], device=scores.device)
    if banned.any():
        scores = scores.clone()
        scores[banned.nonzero(), torch.tensor(stops, device=scores.device)] = float("-inf")
    return scores


def perturb(scores: torch.Tensor, seed: int, sample_ids: list[int], steps: list[int], temperature: float,
            top_k: int, top_p: float, min_new_tokens: int, stops: tuple[int, ...]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-sample sampler's scores and the full log-softmax for rows at response steps ``steps``.

    Gumbel-max: argmax(logits / T + Gumbel noise) is an exact draw from softmax(logits / T) (after top-k/top-p
    and the stop tokens' ban before ``min_new_tokens``). The noise of row i comes from a generator seeded by
    (seed, sample_ids[i], steps[i]). The log-softmax is over the whole vocabulary (no top-k/top-p, no ban):
    what the trainers compute, so the drawn token's entry is the log-prob the trainer will see."""
    scores = scores.float() / temperature
    full = scores.log_softmax(-1)
    scores = ban_stops(scores, steps, min_new_tokens, stops)
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    noise = torch.empty_like(scores)
    for row, (sid, step) in enumerate(zip(sample_ids, steps, strict=True)):
        gen = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + sid) * 65_537 + step)
        u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        noise[row] = (-torch.log(-torch.log(u))).to(noise.device, noise.dtype)
    return scores + noise, full


class PerSampleSampler:
    """:func:`perturb` as a Hugging Face logits processor (greedy decoding of what it returns samples), for
    ``generate``, where every row is at the same step. `prompt_width` is the batch's padded prompt length
    (where the response starts in `input_ids`). It keeps the drawn tokens' log-probs (`logprobs()`). It needs
    the model's own logits: `min_new_tokens` is applied here, after they are read, not by Hugging Face's
    processor (which would run before this one and hide the stop tokens' logits)."""

    def __init__(self, seed: int, sample_ids: list[int], temperature: float, top_k: int, top_p: float,
                 prompt_width: int = 0, min_new_tokens: int = 0, stops: tuple[int, ...] = (),
                 first_steps: list[int] | None = None):
        self.seed, self.sample_ids = seed, list(sample_ids)
        self.first_steps = list(first_steps) if first_steps is not None else [0] * len(self.sample_ids)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.prompt_width = prompt_width
        self.min_new_tokens, self.stops = min_new_tokens, stops
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
        out, full = perturb(scores, self.seed, self.sample_ids, [step + f for f in self.first_steps],
                            self.temperature, self.top_k, self.top_p, self.min_new_tokens, self.stops)
        # greedy decoding takes the argmax of what this returns: that token's log-prob, unbanned and unclipped
        if len(self._logprobs) == step:
            self._logprobs.append(full.gather(-1, out.argmax(-1, keepdim=True)).squeeze(-1).cpu())
        return out


@register_rollout_engine("hf")
class HFGenerate(RolloutEngine):
    """Hugging Face ``generate`` over the whole batch (with ``stages``: the pipeline stages' loop, called like it).
    Padding after a stop token is whatever generate wrote; the log-probs are None when not sampled per sample."""

    pipeline_stages = True

    def generate(self, req: Request) -> tuple[torch.Tensor, torch.Tensor | None]:
        sampler = None
        min_new_tokens = req.min_new_tokens
        if req.do_sample and req.sample_ids is not None:
            sampler = PerSampleSampler(req.seed, req.sample_ids, req.temperature, req.top_k, req.top_p,
                                       prompt_width=req.prompt_ids.shape[1], min_new_tokens=min_new_tokens,
                                       stops=req.stops, first_steps=req.first_steps)
            kwargs = dict(do_sample=False, logits_processor=LogitsProcessorList([sampler]))
            min_new_tokens = 0  # the sampler bans the stop tokens itself, after reading their logits
        elif req.do_sample:
            kwargs = dict(do_sample=True, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)
        else:
            kwargs = dict(do_sample=False)
        out = (self.stages or self.model.generate)(
            input_ids=req.prompt_ids, attention_mask=req.prompt_mask, max_new_tokens=req.max_new_tokens,
            min_new_tokens=min_new_tokens, pad_token_id=req.pad_token_id, eos_token_id=list(req.stops),
            use_cache=True, **kwargs,
        ).cpu()
        response_ids = out[:, req.prompt_ids.shape[1]:]
        return response_ids, None if sampler is None else sampler.logprobs(response_ids.shape[1])


class _SlotLayer(CacheLayerMixin):
    """One layer's KV cache as fixed slots: buffers [slots, heads, capacity, dim], row r holding ``lens[r]``
    tokens from column 0. A decode step writes each row's new key at its own column (no copy of the cache,
    which ``DynamicLayer`` makes every step by concatenating) and returns the columns up to the longest row;
    the attention mask hides each row's columns past its own length."""

    is_sliding = False

    def __init__(self, slots: "_Slots") -> None:
        super().__init__()
        self.slots = slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (self.slots.size, key_states.shape[1], self.slots.capacity, key_states.shape[3])
        # zeros, not empty: a column past a row's length is masked, but a masked NaN still poisons the row
        # (its weight is 0, and 0 * NaN is NaN), and reused memory holds whatever it held
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros(shape[:3] + (value_states.shape[3],))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[0]
        rows, cols = torch.arange(n), self.slots.lens[:n]
        self.keys[rows, :, cols] = key_states[:, :, 0]
        self.values[rows, :, cols] = value_states[:, :, 0]
        width = int(cols.max()) + 1
        return self.keys[:n, :, :width], self.values[:n, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        n = self.slots.live
        return int(self.slots.lens[:n].max()) if n else 0

    def get_max_length(self) -> int:
        return self.slots.capacity


class _Slots:
    """The sequences decoding now: rows 0..live-1 of every layer's slot buffers, the request index of each
    row, its length in the cache and the token it feeds next. A finished row's slot is filled by moving the
    last rows into it, so the live rows stay a prefix (one row's copy per finished sequence)."""

    def __init__(self, model, size: int, capacity: int) -> None:
        if any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or ()):
            raise NotImplementedError("rollout_engine: continuous supports full-attention layers only (this "
                                      f"model has {sorted(set(model.config.layer_types))}); use rollout_engine: hf")
        self.size, self.capacity = size, capacity
        self.lens = torch.zeros(size, dtype=torch.long)
        self.index: list[int] = []
        self.next = torch.zeros(size, dtype=torch.long)
        self.layers = [_SlotLayer(self) for _ in range(model.config.num_hidden_layers)]
        self.cache = Cache(layers=self.layers)

    @property
    def live(self) -> int:
        return len(self.index)

    def add(self, prefill: DynamicCache, width: int, rows: list[int], lengths: list[int], index: list[int],
            nxt: torch.Tensor) -> None:
        """Take rows ``rows`` of a prefill (prompts left-padded to ``width``; ``lengths`` of them real tokens)
        into the next free slots."""
        base = self.live
        for mine, new in zip(self.layers, prefill.layers, strict=True):
            if not mine.is_initialized:
                mine.lazy_initialization(new.keys, new.values)
            for slot, (r, length) in enumerate(zip(rows, lengths, strict=True), base):
                mine.keys[slot, :, :length] = new.keys[r, :, width - length:]
                mine.values[slot, :, :length] = new.values[r, :, width - length:]
        self.lens[base:base + len(rows)] = torch.tensor(lengths, dtype=torch.long)
        self.next[base:base + len(index)] = nxt
        self.index += index

    def drop(self, done: list[int]) -> None:
        """Free the rows in ``done``: the live rows after the new end move into the freed rows below it."""
        if not done:
            return
        keep = self.live - len(done)
        gone = set(done)
        holes = [r for r in done if r < keep]
        movers = [r for r in range(keep, self.live) if r not in gone]
        if holes:
            dst, src = torch.tensor(holes), torch.tensor(movers)
            width = int(self.lens[src].max())
            for layer in self.layers:
                layer.keys[dst, :, :width] = layer.keys[src, :, :width]
                layer.values[dst, :, :width] = layer.values[src, :, :width]
            self.lens[dst], self.next[dst] = self.lens[src], self.next[src]
            for h, m in zip(holes, movers, strict=True):
                self.index[h] = self.index[m]
        del self.index[keep:]


@register_rollout_engine("continuous")
class ContinuousBatching(RolloutEngine):
    """Continuous batching: at most ``req.max_num_seqs`` sequences decode together; a finished one leaves and
    a waiting prompt is prefilled into its slot. Returns what :class:`HFGenerate` returns, padded with
    ``pad_token_id`` after each response (log-probs 0 there). Sampling without sample ids draws with the
    per-sample sampler on the rows' positions in the batch."""

    @classmethod
    def model_problems(cls, model: Any) -> list[str]:
        # its slot cache keeps every position and masks them all alike (no per-row window)
        window = sliding_window(model)
        return [] if window is None else [f"the sliding-window attention (sliding_window {window})"]

    @torch.no_grad()
    def generate(self, req: Request) -> tuple[torch.Tensor, torch.Tensor | None]:
        model = self.model
        cache_name = kv_cache_argument(model)
        device = req.prompt_ids.device
        n = req.prompt_ids.shape[0]
        sample = req.do_sample
        stops = req.stops
        sample_ids = list(req.sample_ids) if req.sample_ids is not None else list(range(n))
        first = list(req.first_steps) if req.first_steps is not None else [0] * n
        prompts = [row[m.bool()] for row, m in zip(req.prompt_ids, req.prompt_mask, strict=True)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        waiting = list(range(n))
        size = max(1, min(req.max_num_seqs, n))
        slots = _Slots(model, size, max(len(p) for p in prompts) + req.max_new_tokens)
        # prefill a group of waiting prompts once this many slots are free (or nothing else is decoding): a
        # prefill per freed sequence would pay a forward's fixed cost almost every step
        refill = max(1, size // 8)

        def pick(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
            steps = [len(tokens[i]) + first[i] for i in rows]
            if sample:
                out, full = perturb(logits, req.seed, [sample_ids[i] for i in rows], steps, req.temperature,
                                    req.top_k, req.top_p, req.min_new_tokens, stops)
                nxt = out.argmax(-1)
                return nxt, full.gather(-1, nxt[:, None]).squeeze(-1)
            return ban_stops(logits.float(), steps, req.min_new_tokens, stops).argmax(-1), None

        def record(rows: list[int], nxt: torch.Tensor, lp: torch.Tensor | None) -> list[int]:
            """Append each row's token; returns the positions (in ``rows``) of the sequences that ended."""
            ended = []
            lps = lp.tolist() if lp is not None else None
            for pos, (i, tok) in enumerate(zip(rows, nxt.tolist(), strict=True)):
                tokens[i].append(tok)
                if lps is not None:
                    logps[i].append(lps[pos])
                if tok in stops or len(tokens[i]) >= req.max_new_tokens:
                    ended.append(pos)
            return ended

        while waiting or slots.live:
            free = size - slots.live
            if waiting and (free >= min(refill, len(waiting)) or not slots.live):
                group, waiting = waiting[:free], waiting[free:]
                lengths = [len(prompts[i]) for i in group]
                width = max(lengths)
                ids = torch.full((len(group), width), req.pad_token_id, dtype=torch.long, device=device)
                mask = torch.zeros((len(group), width), dtype=torch.long, device=device)
                for r, i in enumerate(group):
                    ids[r, width - lengths[r]:] = prompts[i]
                    mask[r, width - lengths[r]:] = 1
                out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                            **{cache_name: DynamicCache(config=model.config)}, use_cache=True, logits_to_keep=1)
                nxt, lp = pick(out.logits[:, -1, :], group)
                ended = set(record(group, nxt, lp))
                going = [r for r in range(len(group)) if r not in ended]
                slots.add(getattr(out, cache_name), width, going, [lengths[r] for r in going],
                          [group[r] for r in going], nxt[going].cpu())
                continue
            # one decode step for every live sequence
            live = slots.live
            lens = slots.lens[:live]
            mask = (torch.arange(int(lens.max()) + 1) <= lens[:, None]).long()
            out = model(input_ids=slots.next[:live, None].to(device), attention_mask=mask.to(device),
                        position_ids=lens[:, None].to(device), **{cache_name: slots.cache}, use_cache=True)
            slots.lens[:live] += 1
            rows = list(slots.index)
            nxt, lp = pick(out.logits[:, -1, :], rows)
            slots.next[:live] = nxt.cpu()
            slots.drop(record(rows, nxt, lp))

        width = max(len(t) for t in tokens)
        response = torch.full((n, width), req.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(n, width)
        for i in range(n):
            response[i, : len(tokens[i])] = torch.tensor(tokens[i], dtype=torch.long)
            if sample:
                logprobs[i, : len(logps[i])] = torch.tensor(logps[i])
        return response, logprobs if sample else None
