"""Padding-free (packed) sequences: what ``models.<name>.packing`` runs.

A padded batch ([B, P] left-padded prompts, [B, R] right-padded responses, see :mod:`chatlearn.data.batch`)
computes every layer on its pad tokens. Packed, the real tokens of all its sequences go one after another into
one row, each sequence with its own position ids (``0..L-1``, exactly the ids the padded path derives from its
mask), and the attention sees each sequence alone:

* :func:`pack` builds that row and the index of the positions that predict each real response token; the LM
  head runs on those positions only (``logits_to_keep``, as in the padded path), and :meth:`Packed.unpack`
  scatters the per-token values (log-probs, entropies, values) back to the [B, R] layout every loss reads, so
  the losses are the padded path's, unchanged.
* ``chatlearn_packed``, the attention implementation a packing model runs (registered with transformers on
  import): a row whose position ids restart is cut into its sequences and each runs causal SDPA alone (the
  sum of their squares, not the row's square: measured fastest on CPU, ``bench/packing.py``); anything else
  (a padded batch, one sequence) is transformers' own SDPA with its own mask, bit for bit.
* :func:`token_budget_groups` cuts a list of samples into micro-batches of at most ``max_token_in_packing``
  tokens (in order: deterministic, the same on every rank), and :func:`regroup` applies it to a global batch.

transformers 5 also builds a block-diagonal mask from restarting position ids when ``attention_mask`` is None
(``masking_utils.find_packed_sequence_indices``), but only without a KV cache (pass ``use_cache=False``: the
model makes one otherwise, and the sequences silently see each other) and as a dense T x T mask.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from chatlearn.data.batch import collate_samples, split_batch

__all__ = ["PACKED_ATTENTION", "Packed", "pack", "packed_tokens", "regroup", "row_chunks", "rows", "sequence_bounds",
           "token_budget_groups", "use_packed_attention"]

PACKED_ATTENTION = "chatlearn_packed"


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sequence of a packed row: a new one starts wherever the position does not go up
    by one (transformers' own rule, ``find_packed_sequence_indices``)."""
    p = position_ids.reshape(-1)
    starts = [0, *((p[1:] - p[:-1]) != 1).nonzero().reshape(-1).add(1).tolist()]
    return list(zip(starts, [*starts[1:], p.numel()], strict=True))


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of a packed row: each sequence attends causally to itself only. Without restarting position
    ids (or with a mask, or a KV cache), transformers' SDPA as it is."""
    position_ids = kwargs.get("position_ids")
    if (attention_mask is not None or position_ids is None or query.shape[0] != 1
            or query.shape[2] != key.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    segments = sequence_bounds(position_ids)
    if len(segments) == 1:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    kwargs = {**kwargs, "is_causal": True}
    outs = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, **kwargs)[0]
            for s, e in segments]
    return torch.cat(outs, dim=1), None


def packed_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask of ``chatlearn_packed``: none for a whole row without a 2-D mask (the attention cuts it by its
    position ids; transformers' dense block-diagonal mask would cost T x T), SDPA's mask otherwise."""
    if (kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length")
            and not kwargs.get("q_offset") and not kwargs.get("kv_offset")):
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switch every Hugging Face model inside ``model`` (a causal LM, a value network's backbone) to
    ``chatlearn_packed``. Padded calls keep SDPA's results exactly (same function, same mask)."""
    for m in model.modules():
        if hasattr(m, "set_attn_implementation") and hasattr(m, "config"):
            m.set_attn_implementation(PACKED_ATTENTION)


class Packed(NamedTuple):
    """Sequences packed into one row (the views of :func:`pack`, in order, each one's rows in order).

    ``input_ids``/``position_ids`` [1, T]: the real tokens and each sequence's positions; ``keep`` [N]: the
    index in the row of the position that predicts each real response token; ``labels`` [N]: those tokens;
    ``slots``: per view, the bool [B, R] of its response slots the N values go back to (row-major order)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    labels: torch.Tensor
    slots: list[torch.Tensor]

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per view, ``values`` [N, ...] (one per response token, in ``keep``'s order) as [B, R, ...], 0 at
        padding (a differentiable scatter)."""
        out, start = [], 0
        for slots in self.slots:
            n = int(slots.sum())
            full = values.new_zeros((*slots.shape, *values.shape[1:]))
            out.append(full.masked_scatter(slots.reshape(*slots.shape, *(1,) * (values.dim() - 1)),
                                           values[start:start + n]))
            start += n
        return out


def pack(views: Sequence[dict], device: torch.device | str = "cpu") -> Packed:
    """Pack the sequences of ``views`` (each a dict with ``prompt_ids``, ``prompt_mask``, ``response_ids``,
    ``response_mask``; e.g. a DPO batch's chosen and rejected sides) into one row.

    The kept tokens are those the padded path attends to (mask 1), with the positions it gives them
    (``cumsum(mask) - 1``), so each sequence computes what it computes padded. A response token is predicted
    by the position before it (the prompt's last token for the first one); a response whose first token has
    no prompt before it would read a pad's output padded and cannot be packed."""
    ids, pos, keep, labels, slots = [], [], [], [], []
    offset = 0
    for view in views:
        p = view["prompt_ids"].shape[1]
        tokens = torch.cat([view["prompt_ids"], view["response_ids"]], 1)
        attn = torch.cat([view["prompt_mask"], view["response_mask"]], 1) > 0
        index = torch.full(attn.shape, -1, dtype=torch.long)
        count = int(attn.sum())
        index[attn] = torch.arange(offset, offset + count)
        resp = view["response_mask"] > 0
        before = index[:, p - 1:p - 1 + resp.shape[1]][resp]  # the column before each response token
        if bool((before < 0).any()):
            raise ValueError("packing: a response token follows padding (an empty prompt, or a response mask with "
                             "a gap); such a batch cannot be packed")
        ids.append(tokens[attn])
        pos.append((attn.long().cumsum(-1) - 1)[attn])
        keep.append(before)
        labels.append(view["response_ids"][resp])
        slots.append(resp.to(device))
        offset += count
    return Packed(torch.cat(ids)[None].to(device), torch.cat(pos)[None].to(device), torch.cat(keep).to(device),
                  torch.cat(labels).to(device), slots)


def packed_tokens(batch: dict, views: Callable[[dict], Sequence[dict]] | None = None) -> list[int]:
    """Tokens each sample of ``batch`` puts into a packed row (its prompt and response; every view's, when
    ``views`` gives several, e.g. DPO's chosen and rejected)."""
    total = torch.zeros(len(batch["prompt_ids"]), dtype=torch.long)
    for v in views(batch) if views is not None else [batch]:
        total += (v["prompt_mask"] > 0).sum(-1) + (v["response_mask"] > 0).sum(-1)
    return total.tolist()


def token_budget_groups(tokens: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive groups of sample indices whose tokens add up to at most ``budget`` each, filled in order
    (deterministic: the same on every rank and after a resume). A sample longer than the budget is a group
    of its own (a sample is never split; the budget bounds what packing adds, not one sequence)."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(tokens):
        if groups and used + n <= budget:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups


def row_chunks(batch: dict, budget: int, views: Callable[[dict], Sequence[dict]] | None = None) -> list[slice]:
    """The rows of ``batch`` cut into consecutive slices of at most ``budget`` packed tokens (one forward each,
    e.g. a scoring pass)."""
    return [slice(g[0], g[-1] + 1) for g in token_budget_groups(packed_tokens(batch, views), budget)]


def rows(batch: dict, part: slice) -> dict:
    """The rows ``part`` of ``batch``: tensors and per-sample lists sliced, anything else as it is."""
    n = len(batch["prompt_ids"])
    return {k: v[part] if isinstance(v, torch.Tensor | list) and len(v) == n else v for k, v in batch.items()}


def regroup(data_list: Sequence[dict], budget: int, pad_token_id: int = 0,
            views: Callable[[dict], Sequence[dict]] | None = None) -> list[dict]:
    """A global batch's micro-batches re-cut by tokens: its samples in order, in micro-batches of at most
    ``budget`` packed tokens (:func:`token_budget_groups`), each collated again (left-padded prompts,
    right-padded responses: the losses read [B, R] tensors; the pads are never computed). The loss weights of
    the step come from the new micro-batches (:mod:`chatlearn.algorithms.aggregation`), so the step is the
    global batch's whatever the cut."""
    samples = [s for mb in data_list for s in split_batch(mb)]
    tokens = [t for mb in data_list for t in packed_tokens(mb, views)]
    return [collate_samples([samples[i] for i in g], pad_token_id) for g in token_budget_groups(tokens, budget)]
