"""Tied weights: names of a state dict that are one tensor, as a model with tied input and output embeddings
has (``model.embed_tokens.weight`` and ``lm_head.weight`` in Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B).

Every writer of weights (checkpoints, sharded checkpoints, the trainer -> inference sync) stores or sends such
a tensor once, under its first name, and records the others as aliases of it; every reader puts the aliases
back as the very same tensor, so what was one parameter is one parameter again. The rule is about storage, not
about a model family: any module whose state dict shares a tensor under several names gets it.

Two names are aliases when they are the same view of the same memory (same storage, offset, shape, strides and
dtype; for a DTensor, the same local view, mesh and placements), or the same object. Names that overlap only
partly (a view of part of another tensor) are not aliases: writers that cannot store shared memory copy them
(:func:`separate_storage`), and loading into the model copies into its own tensors, which still share.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["restore_aliases", "separate_storage", "tied_aliases", "without_aliases"]


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two state-dict entries one tensor (see the module docstring)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.device.type == "meta" or local.numel() == 0 or local.untyped_storage().data_ptr() == 0:
        return ("object", id(t))  # no memory to compare: only the same object is the same tensor
    view = (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            tuple(local.stride()), local.dtype)
    if isinstance(t, DTensor):
        view += (id(t.device_mesh), tuple(t.placements), tuple(t.shape))
    return view


def tied_aliases(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: kept}``: each name that is the same tensor as an earlier name of ``tensors``, mapped to the
    first name of that tensor (mapping order, so a Hugging Face LM keeps ``model.embed_tokens.weight`` and
    aliases ``lm_head.weight``, as ``save_pretrained`` does). Empty when nothing is tied."""
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        kept = first.setdefault(_identity(t), name)
        if kept != name:
            aliases[name] = kept
    return aliases


def without_aliases(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors without the aliases, {alias: kept})``: what to store or send once, and how to tie it again."""
    aliases = tied_aliases(tensors)
    return {k: v for k, v in tensors.items() if k not in aliases}, aliases


def restore_aliases(tensors: dict[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """Put each alias back into ``tensors`` (in place, and returned) as the very tensor of the name it aliases.
    An alias whose name is already there, or whose kept name is not, is an error: the two do not belong together."""
    for alias, kept in aliases.items():
        if alias in tensors or kept not in tensors:
            raise ValueError(f"tied weights: cannot make {alias!r} an alias of {kept!r} "
                             f"({'it is stored itself' if alias in tensors else f'{kept!r} is missing'})")
        tensors[alias] = tensors[kept]
    return tensors


def separate_storage(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every tensor that shares memory with an earlier one copied (for formats such as
    safetensors that refuse shared memory); call it after :func:`without_aliases`, so what is left to copy is
    only memory shared in part."""
    seen: set[tuple[torch.device, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and (t.device, ptr) in seen:
            t = t.clone()
        elif ptr:
            seen.add((t.device, ptr))
        out[name] = t
    return out
