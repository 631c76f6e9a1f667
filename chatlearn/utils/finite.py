"""Non-finite numbers stop the run, not the model: the checks the reward, trainer and checkpoint code call.

A NaN or an infinity that reaches a loss spreads to every weight at the next optimizer step, and from there to
every checkpoint, the exported policy and the metrics, while the run goes on and exits 0. So each place that
makes a number the next one depends on (a reward, an advantage, a loss, a gradient norm) checks it where it is
made, and says which one and where in a `RunError`; the checkpoint writers check every tensor once more before
writing, whatever path a NaN took. The checks are one `torch.isfinite(...).all()` per tensor.
"""

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from chatlearn.utils.errors import RunError

PROMPT_CHARS = 60  # how much of a prompt an error quotes


def nonfinite_summary(value: Any) -> str | None:
    """None when ``value`` (a number or a tensor) is finite everywhere; else what is wrong, e.g. ``nan`` for a
    number or ``nan in 3 of 128 values`` for a tensor."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() and not value.is_complex():
            return None  # integer and bool tensors cannot hold NaN or infinity
        t = value.detach()
        if bool(torch.isfinite(t).all()):
            return None
        if t.numel() == 1:
            return str(float(t.reshape(())))
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        kinds = " and ".join(f"{kind} in {n}" for kind, n in (("nan", nan), ("inf", inf)) if n)
        return f"{kinds} of {t.numel()} values"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isfinite(value) else str(float(value))


def require_finite(value: Any, what: str, hint: str = "") -> None:
    """A RunError ``"<what> is nan<hint>"`` when ``value`` (a number or a tensor) is not finite."""
    bad = nonfinite_summary(value)
    if bad is not None:
        raise RunError(f"{what} is {bad}{hint}")


def nonfinite_rows(value: torch.Tensor, mask: torch.Tensor | None = None) -> list[int]:
    """The rows (first dimension) of ``value`` holding a NaN or an infinity where ``mask`` is on (padding
    positions may hold anything: a masked-out log-prob can be -inf)."""
    t = value.detach()
    if not t.is_floating_point():
        return []
    bad = ~torch.isfinite(t)
    if mask is not None and mask.shape == t.shape:
        bad &= mask.to(bad.device).bool()
    if t.dim() == 0:
        return [0] if bool(bad) else []
    return torch.nonzero(bad.reshape(t.shape[0], -1).any(dim=1)).flatten().tolist()


def describe_sample(sample: Mapping[str, Any], index: int | None = None) -> str:
    """How an error names a sample: its index in the episode (or eval set) when known, its ``sample_id`` (the
    position in the response stream, what a hook sees) when that differs, and the beginning of its prompt;
    e.g. ``sample 17 (prompt "max 3 7 1 ?")``. The prompt is JSON-quoted, so the error stays on one line."""
    sid = sample.get("sample_id")
    parts = []
    if index is not None:
        head = f"sample {index}"
        if sid is not None and sid != index:
            parts.append(f"sample_id {sid}")
    else:
        head = f"sample_id {sid}" if sid is not None else "a sample"
    prompt = sample.get("prompt")
    if prompt is not None:
        text = str(prompt)
        short = text[:PROMPT_CHARS] + ("..." if len(text) > PROMPT_CHARS else "")
        parts.append(f"prompt {json.dumps(short, ensure_ascii=False)}")
    return head + (f" ({', '.join(parts)})" if parts else "")


def batch_sample(data: Mapping[str, Any], row: int) -> dict[str, Any]:
    """Row ``row`` of a dict batch: the fields `describe_sample` reads (``sample_id``, ``prompt``)."""
    out: dict[str, Any] = {}
    for key in ("sample_id", "prompt"):
        column = data.get(key)
        if isinstance(column, list | tuple) and row < len(column):
            out[key] = column[row]
    return out


def one_line(text: Any, limit: int = 300) -> str:
    """``text`` on one line (whitespace runs, newlines included, become one space), at most ``limit`` chars:
    a user's exception message goes into a one-line error; its full text is in the log's traceback."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        # a DTensor's own shard only: checking the whole one would be a collective of its ranks
        yield prefix, obj.to_local() if hasattr(obj, "to_local") else obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")


def first_nonfinite(tensors: Any, where: str) -> str | None:
    """What `check_finite_tensors` would raise, as its message, or None when every tensor is finite."""
    for name, t in _tensors(tensors, ""):
        bad = nonfinite_summary(t)
        if bad is not None:
            return f"{where} {name or 'a tensor'} has {bad if t.numel() > 1 else 'value ' + bad}"
    return None


def check_finite_tensors(tensors: Any, where: str) -> None:
    """A RunError naming the first tensor (in a nested dict/list, e.g. a state dict or an optimizer state) that
    holds a NaN or an infinity: ``<where> <name> has nan in 3 of 4096 values``."""
    found = first_nonfinite(tensors, where)
    if found is not None:
        raise RunError(found)


def agree_finite(found: str | None, group: Any) -> None:
    """Every rank of ``group`` calls this with what it found in its own shard (`first_nonfinite`); when any rank
    found a non-finite tensor, every rank raises the same RunError (the lowest such rank's message).

    A rank that raised on its own shard would leave its peers waiting in the next collective (a checkpoint's
    barrier) until the group's timeout. So the ranks agree first: one all-reduce of a flag (the usual case,
    all finite, costs only that), then, only when it is set, one all-gather of the messages. ``group`` None
    (one process): raise what was found."""
    import torch.distributed as dist  # only sharded checkpoints get here

    if group is None or not dist.is_initialized():
        if found is not None:
            raise RunError(found)
        return
    # NCCL reduces CUDA tensors only; every other backend here (gloo) takes CPU ones
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    flag = torch.tensor([0 if found is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, found, group=group)
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise RunError(f"{message} (in rank {rank}'s shard)")
