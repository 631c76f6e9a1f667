"""Batches as plain dicts of tensors, and the split/collate pair that moves between batches and samples.

A batch carries left-padded prompts (`prompt_ids`, `prompt_mask`, shape [B, P]) and right-padded responses
(`response_ids`, `response_mask`, [B, R]); every other 2-D tensor is aligned with the response tokens
([B, R], e.g. log-probs, values, advantages), every 1-D tensor is one number per sample ([B], e.g. scores),
and lists hold one Python object per sample (prompt text, answers). A preference pair carries its second
response as ``rejected_ids``/``rejected_mask``: 2-D tensors named ``rejected_*`` align with those tokens.
A multi-turn sample's response holds the policy's answers and the environment's observations: ``loss_mask`` [B, R]
is 1 at the tokens the policy generated and 0 at the observations' (`loss_mask` reads it; a batch without one,
every single-turn sample, counts every response token). Splitting a batch into per-sample dicts
drops the padding, so samples from batches of different shapes can be re-batched freely (micro-batches are
not generation batches).
"""

from collections.abc import Sequence
from typing import Any

import torch

PROMPT_KEYS = ("prompt_ids", "prompt_mask")
TOKEN_KEYS = ("prompt_ids", "response_ids", "rejected_ids")  # padded with the pad token, the rest with 0
REJECTED = "rejected_"  # prefix of the tensors aligned with a pair's rejected response


def batch_size(batch: dict[str, Any]) -> int:
    """Number of samples in a batch dict."""
    for value in batch.values():
        return len(value)
    return 0


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """The response tokens the losses, advantages and their normalisers count: the policy's own tokens
    (``loss_mask``, a multi-turn sample's), else every response token (``response_mask``)."""
    mask = batch.get("loss_mask")
    return batch["response_mask"] if mask is None else mask


def split_batch(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-sample dicts with the padding removed."""
    n = batch_size(batch)
    prompt_len = batch["prompt_mask"].sum(-1).tolist() if "prompt_mask" in batch else None
    resp_len = batch["response_mask"].sum(-1).long().tolist() if "response_mask" in batch else None
    rej_len = batch["rejected_mask"].sum(-1).long().tolist() if "rejected_mask" in batch else None
    samples: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, value in batch.items():
        for i in range(n):
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                if key in PROMPT_KEYS:
                    samples[i][key] = value[i, value.shape[1] - int(prompt_len[i]) :].clone()
                elif key.startswith(REJECTED) and rej_len is not None:
                    samples[i][key] = value[i, : int(rej_len[i])].clone()
                else:
                    samples[i][key] = value[i, : int(resp_len[i])].clone()
            elif isinstance(value, torch.Tensor):
                samples[i][key] = value[i].clone()
            else:
                samples[i][key] = value[i]
    return samples


def collate_samples(samples: Sequence[dict[str, Any]], pad_token_id: int = 0) -> dict[str, Any]:
    """Inverse of `split_batch`: left-pad prompt tensors, right-pad response-aligned tensors."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    out: dict[str, Any] = {}
    for key, first in samples[0].items():
        values = [s[key] for s in samples]
        if isinstance(first, torch.Tensor) and first.dim() == 1:
            width = max(v.shape[0] for v in values)
            pad = pad_token_id if key in TOKEN_KEYS else 0
            stacked = torch.full((len(values), width), pad, dtype=first.dtype)
            for i, v in enumerate(values):
                if key in PROMPT_KEYS:
                    stacked[i, width - v.shape[0] :] = v
                else:
                    stacked[i, : v.shape[0]] = v
            out[key] = stacked
        elif isinstance(first, torch.Tensor):
            out[key] = torch.stack(values)
        else:
            out[key] = list(values)
    return out


def merge_batches(*batches: dict[str, Any]) -> dict[str, Any]:
    """Union of the keys of several outputs for the same samples (later outputs win on clashes)."""
    merged: dict[str, Any] = {}
    for b in batches:
        merged.update(b)
    return merged
