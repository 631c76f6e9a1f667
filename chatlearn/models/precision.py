"""bf16 mixed precision (`models.<name>.args_dict.bf16`, ChatLearn's field).

A model that trains keeps fp32 weights (the optimizer's master weights and AdamW's state stay fp32); its
decoder layers and LM head run under ``torch.autocast(bfloat16)``, entered by a forward pre-hook on each of
those modules, so every path that calls them (the whole model, DDP/FSDP2 wrappers, pipeline stages, the
packed forward) computes in bf16 while what comes after them does not: log-probs, entropies, ratios, KL,
values and the losses read the bf16 logits upcast to fp32 (``logprobs_from_logits`` does it chunk by chunk).
A model that only infers holds bf16 weights; the sync casts the trainer's fp32 weights to them on the way
(it sends what the inference model holds).

bf16 on CPU runs its matmuls through oneDNN, which builds (JIT-compiles) a kernel, a "primitive", for each exact
shape and keeps it in two LRU caches of 1,024 entries each: oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``)
and ideep's, PyTorch's oneDNN wrapper (``LRU_CACHE_CAPACITY``); fp32 matmuls keep no such cache. A primitive
with its scratchpad takes about half a megabyte on an AMX CPU. Padded batches use a handful of shapes; packed
micro-batches (``packing``: one row of as many tokens as the micro-batch holds) and continuous batching (as many
rows as sequences are decoding) bring a new shape to most calls, so the caches kept filling for hundreds of
episodes: the model process of a bf16, packed, continuous run grew by 10-15 MB an episode at first, for as long
as the caches had room (``bench/memory_soak.py``). :func:`bound_kernel_caches` caps both at
:data:`KERNEL_CACHE_CAPACITY` entries: the shapes of a micro-batch (every linear's forward and its two backward
products, reused by every layer) still hit, and a shape that has left the cache is compiled again (about 2 ms a
kernel here), into the same code: results do not change. Both capacities are read once per process, when its
first kernel is built, so every model process sets them before any model computes
(:meth:`chatlearn.models.torch_module.TorchModule.bind`); capacities already in the environment (the user's own
choice) are kept.
"""

import os
from collections.abc import MutableMapping
from typing import Any

import torch

__all__ = ["CACHE_VARIABLES", "KERNEL_CACHE_CAPACITY", "autocast_bf16", "autocast_modules", "bound_kernel_caches"]

#: Entries kept in each oneDNN kernel cache: a few micro-batches' shapes (1,024 is oneDNN's default).
KERNEL_CACHE_CAPACITY = 128
#: oneDNN's primitive cache, then ideep's.
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def autocast_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that run under autocast: every decoder layer (class name ``*DecoderLayer``, as in the
    Hugging Face Llama, Qwen2/3 and Mistral classes) and the output embedding (the LM head), when any."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(f"bf16: {type(model).__name__} has no *DecoderLayer modules to run in bf16; "
                         "set bf16: false or dtype: bfloat16 (bf16 weights)")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return layers + ([head] if head is not None else [])


def autocast_bf16(model: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """Run ``model``'s decoder layers and LM head under bf16 autocast (weights untouched). Returns it."""
    for module in autocast_modules(model):
        stack: list[Any] = []

        def enter(_module: torch.nn.Module, _args: Any, stack: list = stack) -> None:
            ctx = torch.autocast(device_type=device_type, dtype=torch.bfloat16)
            ctx.__enter__()
            stack.append(ctx)

        def leave(_module: torch.nn.Module, _args: Any, _out: Any, stack: list = stack) -> None:
            stack.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)  # an exception in forward still leaves it
    return model


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY,
                        environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Cap both oneDNN kernel caches at ``capacity`` entries unless ``environ`` already sets them; returns what
    is in effect. Acts only before the process's first oneDNN kernel (both are read once)."""
    for var in CACHE_VARIABLES:
        environ.setdefault(var, str(capacity))
    return {var: environ[var] for var in CACHE_VARIABLES}
