"""bf16 mixed precision (`models.<name>.args_dict.bf16`, ChatLearn's field).

A model that trains keeps fp32 weights (the optimizer's master weights and AdamW's state stay fp32); its
decoder layers and LM head run under ``torch.autocast(bfloat16)``, entered by a forward pre-hook on each of
those modules, so every path that calls them (the whole model, DDP/FSDP2 wrappers, pipeline stages, the
packed forward) computes in bf16 while what comes after them does not: log-probs, entropies, ratios, KL,
values and the losses read the bf16 logits upcast to fp32 (``logprobs_from_logits`` does it chunk by chunk).
A model that only infers holds bf16 weights; the sync casts the trainer's fp32 weights to them on the way
(it sends what the inference model holds).
"""

from typing import Any

import torch

__all__ = ["autocast_bf16", "autocast_modules"]


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
