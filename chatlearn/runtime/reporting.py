"""Where per-episode metrics go: a progress bar, a metrics line, `metrics.jsonl`, and artifact tables."""

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from chatlearn.config import ChatLearnConfig

# Column order of the metrics line and the artifact table (keys that are absent are skipped).
LINE_KEYS = ["reward_mean", "eval_reward_mean", "eval_exact_match", "eval_preference_accuracy", "kl_mean",
             "policy_loss", "value_loss", "clipfrac", "kl_loss", "dpo_loss", "reward_accuracy", "pair_accuracy",
             "response_length_mean", "episode_seconds", "peak_memory_mb"]


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def artifact_key(exp_name: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{exp_name}-{what}".lower()).strip("-")


class EpisodeReporter:
    """Appends one JSON object per episode to `metrics.jsonl` and shows progress in the terminal."""

    def __init__(self, cfg: ChatLearnConfig, run_dir: Path, first_episode: int = 0):
        """`first_episode` > 0 on resume: rows of earlier episodes are kept, later ones (written by the run
        that crashed after its last checkpoint) are dropped, since those episodes run again."""
        self.cfg = cfg
        self.log_interval = max(1, cfg.runtime.log_interval or 1)
        self.path = run_dir / "metrics.jsonl"
        self.rows = [r for r in self._read_rows() if r.get("episode", -1) < first_episode]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in self.rows))
        os.replace(tmp, self.path)
        self.bar = tqdm(total=cfg.runtime.num_episode, initial=first_episode, desc="episodes", unit="ep",
                        file=sys.stderr, dynamic_ncols=True)

    def _read_rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by a crash: it and anything after belong to re-run episodes
        return rows

    def artifact_key(self, what: str) -> str:
        return artifact_key(self.cfg.runtime.exp_name, what)

    def record(self, metrics: dict[str, Any]) -> None:
        row = {k: v for k, v in metrics.items() if k not in ("eval_examples",)}
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)
        self.bar.update(1)
        self.bar.set_postfix(reward=_fmt(metrics.get("reward_mean")), refresh=False)
        episode = metrics["episode"]
        if (episode + 1) % self.log_interval == 0 or "eval_reward_mean" in metrics:
            parts = [f"{k}={_fmt(metrics[k])}" for k in LINE_KEYS if metrics.get(k) is not None]
            stages = " ".join(f"{k}={v:.2f}s" for k, v in metrics.get("stage_seconds", {}).items())
            self.bar.write(f"[episode {episode + 1}/{self.cfg.runtime.num_episode}] " + " ".join(parts)
                           + f" | {stages}")
        for ex in metrics.get("eval_examples", [])[:2]:
            self.bar.write(f"    eval: {ex['prompt']!r} -> {ex['response']!r} (score {_fmt(ex['score'])})")

    def table(self) -> list[dict[str, Any]]:
        return [{"episode": r["episode"], **{k: r.get(k) for k in LINE_KEYS}} for r in self.rows]

    def close(self) -> None:
        self.bar.close()
