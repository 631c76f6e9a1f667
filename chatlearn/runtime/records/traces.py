"""Every sample of an episode, kept: ``run_dir/traces/episode_NNNNNN.parquet`` (``runtime.trace_samples``).

The StreamDataset, which holds an episode's samples, turns them into rows of plain values (`trace_rows`); the
driver's recorder writes them beside the episode's metrics row (`write_trace`), whole or not at all (a temporary
file, renamed). A start that resumes after episode N removes the tables of the episodes after N
(`drop_traces_after`), as it cuts their metrics rows: those episodes run again and write them again, so a
resumed run's tables are the uninterrupted run's, none twice. `read_traces` is what `chatlearn trace` reads.
"""

import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from chatlearn.utils.files import fsync_file
from chatlearn.utils.storage import writing

__all__ = ["TRACE_DIR", "drop_traces_after", "explaining", "read_traces", "trace_path", "trace_rows", "write_trace"]

TRACE_DIR = "traces"

# per-sample values copied as they are, when the samples carry them: agents' turns and tool calls, a partial
# rollout's rounds, DAPO's overlong shaping, an environment's own reward
_SCALARS = ("turns", "tool_calls", "tool_errors", "env_reward", "rollout_round", "overlong_penalty")


def _masked_mean(values: Any, mask: Any) -> float | None:
    """The mean of a per-token tensor over the response's tokens (a scalar as it is)."""
    if values is None:
        return None
    values = torch.as_tensor(values, dtype=torch.float64)
    if values.dim() == 0:
        return float(values)
    if mask is None:
        return float(values.mean()) if values.numel() else None
    mask = torch.as_tensor(mask, dtype=torch.float64)[: values.shape[-1]]
    count = float(mask.sum())
    return float((values[: mask.shape[-1]] * mask).sum() / count) if count else None


def trace_rows(samples: list[dict[str, Any]], trained: Iterable[int], episode: int, keep: str | int,
               seed: int) -> list[dict[str, Any]]:
    """One row per sample of episode ``episode`` (0-based; the rows count from 1, as metrics.jsonl does):
    ids, texts, token counts, every reward by name, the advantage, return and log-probs averaged over the
    response's tokens, the weights version that generated it and its staleness, and whether it trained (``trained``:
    the training samples' ids; dynamic sampling drops groups). ``keep``: 'all', 'none' or a number drawn at
    random (the same ones for the same ``seed`` and episode)."""
    if keep == "none" or not samples:
        return []
    trained = set(trained)
    chosen = list(samples)
    if isinstance(keep, int) and keep < len(chosen):
        picked = sorted(random.Random(seed * 1_000_003 + episode).sample(range(len(chosen)), keep))
        chosen = [chosen[i] for i in picked]
    rows = []
    for s in chosen:
        mask = s.get("loss_mask", s.get("response_mask"))
        version = int(s.get("policy_version", episode))
        row: dict[str, Any] = {
            "episode": episode + 1, "sample_id": int(s.get("sample_id", -1)), "group_id": int(s.get("group_id", -1)),
            "prompt": s.get("prompt"), "response": s.get("response"),
            "prompt_tokens": int(torch.as_tensor(s["prompt_mask"]).sum()) if "prompt_mask" in s else None,
            "response_tokens": int(torch.as_tensor(mask).sum()) if mask is not None else None,
            "reward": float(s["scores"]) if "scores" in s else None,
        }
        row.update({k: float(v) for k, v in sorted(s.items()) if k.startswith("rewards/")})
        row["advantage"] = _masked_mean(s.get("advantages"), mask)
        row["return"] = _masked_mean(s.get("returns"), mask)
        row["kl"] = float(torch.as_tensor(s["kl"], dtype=torch.float64).sum()) if "kl" in s else None
        row["policy_version"], row["staleness"] = version, episode - version
        row["logprob_mean"] = _masked_mean(s.get("logprobs"), mask)  # the sampler's
        row["trainer_logprob_mean"] = _masked_mean(s.get("old_logprobs"), mask)  # with old_logprobs: trainer
        row.update({k: float(s[k]) for k in _SCALARS if k in s})
        row["trained"] = int(s.get("sample_id", -1)) in trained
        rows.append(row)
    return rows


# what an episode's samples artifact shows of each (the whole row is in the table on disk)
SHOWN = ("sample_id", "reward", "advantage", "policy_version", "staleness", "prompt", "response")


def explaining(rows: list[dict[str, Any]], seed: int, k: int = 3, width: int = 200) -> list[dict[str, Any]]:
    """The samples that explain an episode, for its page in the UI: the ``k`` of highest and of lowest advantage
    (reward without one), then ``k`` others at random (the same for the same ``seed`` and episode); texts cut to
    ``width`` characters, floats to 4 digits (the table on disk keeps them whole)."""
    key = "advantage" if any(r.get("advantage") is not None for r in rows) else "reward"
    ranked = sorted((r for r in rows if r.get(key) is not None), key=lambda r: (-r[key], r["sample_id"]))
    top, bottom = ranked[:k], ranked[k:][-k:]
    chosen = {id(r) for r in top + bottom}
    rest = [r for r in rows if id(r) not in chosen]
    episode = rows[0]["episode"] if rows else 0
    picked = sorted(random.Random(seed * 1_000_003 + episode).sample(range(len(rest)), min(k, len(rest))))
    out = []
    for which, group in (("highest " + key, top), ("lowest " + key, bottom), ("at random", [rest[i] for i in picked])):
        for r in group:
            row = {"shown": which}
            row.update({c: _shown(r.get(c), width) for c in SHOWN})
            out.append(row)
    return out


def _shown(value: Any, width: int) -> Any:
    """A value as a table in the UI shows it: a text cut to ``width`` characters, a float to 4 digits."""
    if isinstance(value, str):
        return value[:width] + ("..." if len(value) > width else "")
    if isinstance(value, float):
        return float(f"{value:.4g}")
    return value


def trace_path(run_dir: str | Path, episode: int) -> Path:
    """Where episode ``episode``'s table (0-based) goes."""
    return Path(run_dir) / TRACE_DIR / f"episode_{episode + 1:06d}.parquet"


def write_trace(run_dir: str | Path, episode: int, rows: list[dict[str, Any]]) -> int:
    """Episode ``episode``'s rows as its table, whole or not at all; returns the file's size in bytes (0: no
    rows, no file)."""
    if not rows:
        return 0
    import pyarrow as pa  # here: only a run that keeps traces needs Arrow in the driver
    import pyarrow.parquet as pq

    path = trace_path(run_dir, episode)
    tmp = path.with_suffix(".parquet.tmp")
    with writing("an episode's samples", path, cleanup=tmp):  # a full disk: one line, no half-written file
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        fsync_file(str(tmp))
        os.replace(tmp, path)
    return path.stat().st_size


def drop_traces_after(run_dir: str | Path, first: int) -> None:
    """Remove the tables of episodes ``first`` on (0-based) and any half-written one: a start from there writes
    them again."""
    folder = Path(run_dir) / TRACE_DIR
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        number = path.name.removeprefix("episode_").removesuffix(".parquet")  # as `trace_path` names them
        if path.name.endswith(".tmp") or (number.isdigit() and int(number) > first):
            path.unlink()


def read_traces(run_dir: str | Path, episode: int | None = None) -> Any:
    """The run's trace tables as one pandas DataFrame (``episode``: counted from 1, that one only)."""
    import pandas as pd  # here: the command that reads them needs it, not a run

    folder = Path(run_dir) / TRACE_DIR
    paths = sorted(folder.glob("episode_*.parquet")) if folder.is_dir() else []
    if episode is not None:
        paths = [p for p in paths if p == trace_path(run_dir, episode - 1)]
    if not paths:
        return pd.DataFrame()
    return pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True)
