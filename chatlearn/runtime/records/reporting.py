"""Where per-episode metrics go: a progress bar, a metrics line, `metrics.jsonl`, a curve `curves.png`, and
Prefect artifacts (one metrics table and one curve per run, updated in place each episode)."""

import base64
import io
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.context import FlowRunContext
from prefect.utilities.urls import url_for
from tqdm import tqdm

from chatlearn.config import ChatLearnConfig
from chatlearn.runtime.prefect import api_link
from chatlearn.utils.storage import writing

# Column order of the metrics line and the artifact table (keys that are absent are skipped).
LINE_KEYS = ["reward_mean", "eval_reward_mean", "eval_exact_match", "eval_preference_accuracy", "kl_mean",
             "policy_loss", "value_loss", "clipfrac", "kl_loss", "dpo_loss", "reward_accuracy", "pair_accuracy",
             "response_length_mean", "turns_mean", "tool_calls_mean", "eval_turns_mean", "episode_seconds",
             "peak_memory_mb"]


def user_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """An episode's metrics as the user sees them (`metrics.jsonl`, `summary.json`, the train flow's result):
    the episode counted from 1, the eval examples left to the terminal."""
    return {**{k: v for k, v in metrics.items() if k != "eval_examples"}, "episode": metrics["episode"] + 1}


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def artifact_key(exp_name: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{exp_name}-{what}".lower()).strip("-")


class EpisodeReporter:
    """Appends one JSON object per episode to `metrics.jsonl` and shows progress in the terminal. A row's
    `episode` counts from 1, as the terminal, the UI's episode subflows and the trackers do (the train flow's
    own episode index, ChatLearn's, counts from 0)."""

    def __init__(self, cfg: ChatLearnConfig, run_dir: Path, first_episode: int = 0):
        """`first_episode` (the index the run starts at) > 0 on resume: the rows of the episodes before it are
        kept, later ones (written by the run that crashed after its last checkpoint) are dropped, since those
        episodes run again."""
        self.cfg = cfg
        self.log_interval = max(1, cfg.runtime.log_interval or 1)
        self.path = run_dir / "metrics.jsonl"
        self.rows = [r for r in self._read_rows() if r.get("episode", first_episode + 1) <= first_episode]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with writing("metrics", self.path, cleanup=tmp):  # a full disk: one RunError naming the file
            tmp.write_text("".join(json_line(r) + "\n" for r in self.rows))
            os.replace(tmp, self.path)
        # without a terminal (CI, nohup, a pipe) no bar: its redraws would fill the log; one line per episode
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=cfg.runtime.num_episode, initial=first_episode, desc="episodes", unit="ep",
                        file=sys.stderr, dynamic_ncols=True, disable=not self.tty)

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
        row = user_row(metrics)
        # a row cut short by a full disk is dropped by the next run's reader (`_read_rows`)
        with writing("metrics", self.path), self.path.open("a") as f:
            f.write(json_line(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)
        self.bar.update(1)
        self.bar.set_postfix(reward=_fmt(metrics.get("reward_mean")), refresh=False)
        episode = metrics["episode"]
        head = f"[episode {episode + 1}/{self.cfg.runtime.num_episode}] "
        if (episode + 1) % self.log_interval == 0 or "eval_reward_mean" in metrics:
            parts = [f"{k}={_fmt(metrics[k])}" for k in LINE_KEYS if metrics.get(k) is not None]
            stages = " ".join(f"{k}={v:.2f}s" for k, v in metrics.get("stage_seconds", {}).items())
            self.write(head + " ".join(parts) + f" | {stages}")
        elif not self.tty:  # the bar's place: one short line
            self.write(head + " ".join(f"{k}={_fmt(metrics[k])}" for k in ("reward_mean", "episode_seconds")
                                       if metrics.get(k) is not None))
        for ex in metrics.get("eval_examples", [])[:2]:
            self.write(f"    eval: {ex['prompt']!r} -> {ex['response']!r} (score {_fmt(ex['score'])})")

    def write(self, line: str) -> None:
        """A line on the terminal (stdout) above the progress bar."""
        self.bar.write(line, file=sys.stdout)

    def table(self) -> list[dict[str, Any]]:
        return table_rows(self.rows)

    def close(self) -> None:
        self.bar.close()


SUMMARY_KEYS = ("reward_mean", "eval_reward_mean", "eval_exact_match", "kl_mean", "policy_loss", "value_loss",
                "dpo_loss", "response_length_mean", "turns_mean", "tool_calls_mean", "eval_turns_mean")


def flow_run_url() -> str | None:
    """The UI address of the flow run this is called in (None outside one, or without a UI)."""
    ctx = FlowRunContext.get()
    return url_for(ctx.flow_run) if ctx is not None and ctx.flow_run is not None else None


def run_summary(rows: list[dict[str, Any]], num_episode: int, run_dir: Path, tracker_links: dict[str, str],
                ui_url: str | None) -> dict[str, Any]:
    """What the end of a run shows (``summary``, in `summary.json` too): episodes done, each summary metric's
    last value (with the episode it is from, counted from 1), where the run is, the UI and tracker links."""
    final: dict[str, Any] = {}
    for key in SUMMARY_KEYS:
        for row in reversed(rows):
            if row.get(key) is not None:
                final[key] = {"value": row[key], "episode": row["episode"]}
                break
    seconds = sum(r.get("episode_seconds") or 0.0 for r in rows)
    return {"summary": {"episodes": f"{len(rows)} of {num_episode}", "train_seconds": seconds, "final": final,
                        "run_dir": str(run_dir), "ui": ui_url, "trackers": dict(tracker_links)}}


def summary_text(result: dict[str, Any]) -> str:
    """The short table `chatlearn train` ends with: final metrics, run directory, final policy, UI and tracker
    links (from the train flow's result)."""
    summary = result.get("summary") or {}
    lines: list[tuple[str, str]] = [("episodes", f"{summary.get('episodes', '?')} "
                                                 f"({summary.get('train_seconds', 0.0):.1f} s of episodes)")]
    for key, got in (summary.get("final") or {}).items():
        lines.append((key, f"{_fmt(got['value'])} (episode {got['episode']})"))
    lines.append(("run directory", summary.get("run_dir") or "?"))
    if result.get("final_policy"):
        lines.append(("final policy", result["final_policy"]))
    if summary.get("ui"):
        lines.append(("Prefect UI", summary["ui"]))
    lines += list((summary.get("trackers") or {}).items())
    width = max(len(k) for k, _ in lines)
    return "\n".join(["run summary"] + [f"  {k.ljust(width)}  {v}" for k, v in lines])


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics table: one row per episode (counted from 1, as everywhere the user looks), the metrics
    line's columns (absent ones are None)."""
    return [{"episode": r["episode"], **{k: r.get(k) for k in LINE_KEYS}} for r in rows]


# Figure size in inches and dots per inch of `curves.png`: 480 x 280 pixels, small enough (tens of kB) to
# travel inside a markdown artifact as a data URI.
CURVE_SIZE = (6.0, 3.5)
CURVE_DPI = 80


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(episode numbers, values) of the rows that have a finite `key`."""
    points = [(r["episode"], float(r[key])) for r in rows
              if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [x for x, _ in points], [y for _, y in points]


def curves_png(rows: list[dict[str, Any]]) -> bytes:
    """A PNG of reward_mean, eval_reward_mean (the episodes eval ran, the eval before training at episode 0)
    and kl_mean (right axis: its scale is far below the reward's) per episode, from the metrics rows.

    Matplotlib's object API on the Agg canvas: no display, no pyplot global state, so it is safe in a flow
    process that has other threads."""
    # lazy: matplotlib (~0.5 s to import) loads only when a run draws its first curve
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=CURVE_SIZE, dpi=CURVE_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    handles = []
    x, y = _series(rows, "reward_mean")
    handles += ax.plot(x, y, color="tab:blue", marker="." if len(x) < 30 else None, label="reward_mean")
    ex, ey = _series(rows, "eval_reward_mean")
    _, by = _series(rows, "eval_reward_mean_before_training")
    if by:  # the baseline the eval curve starts from, before episode 1
        ex, ey = [0, *ex], [by[0], *ey]
    if ex:
        handles += ax.plot(ex, ey, color="tab:green", marker="o", label="eval_reward_mean")
    ax.set_xlabel("episode")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("reward")
    kx, ky = _series(rows, "kl_mean")
    if kx:
        kl_ax = ax.twinx()
        handles += kl_ax.plot(kx, ky, color="tab:red", linestyle="--", label="kl_mean")
        kl_ax.set_ylabel("KL")
    if handles:
        ax.legend(handles=handles, loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_curves(rows: list[dict[str, Any]], path: Path) -> bytes:
    """Write `curves_png(rows)` to ``path`` (through a temporary file, so a reader never sees half a PNG);
    returns the PNG's bytes."""
    png = curves_png(rows)
    tmp = path.with_suffix(".png.tmp")
    with writing("the curves", path, cleanup=tmp):
        tmp.write_bytes(png)
        os.replace(tmp, path)
    return png


def json_safe(item: Any) -> Any:
    """NaN and infinities become None, as Prefect's table artifact does for NaN: the data is stored as JSON."""
    if isinstance(item, list | tuple):
        return [json_safe(v) for v in item]
    if isinstance(item, dict):
        return {k: json_safe(v) for k, v in item.items()}
    if isinstance(item, float) and not math.isfinite(item):
        return None
    return item


def json_line(row: dict[str, Any]) -> str:
    """One line of `metrics.jsonl`: strict JSON, which Python's default writer is not (it writes a bare
    ``NaN``, which other readers reject). The run stops on a non-finite reward, advantage, loss or gradient
    norm (`chatlearn.utils.finite`); any other non-finite number (an eval hook's metric, a diagnostic) is
    written as null. Objects JSON does not know are written as their str()."""
    return json.dumps(json_safe(row), default=str, allow_nan=False)


class RunArtifacts:
    """The run's metrics table and curve as Prefect artifacts: created once, at the first update, inside the
    train flow run (so they belong to it), then updated in place, so the UI shows one artifact of each per
    run instead of a new version per episode."""

    def __init__(self, exp_name: str, run_dir: Path):
        self.exp_name = exp_name
        self.curves_path = run_dir / "curves.png"
        self.ids: dict[str, UUID] = {}

    def update(self, rows: list[dict[str, Any]]) -> None:
        """Show ``rows`` (every episode so far): rewrite `curves.png` and refresh both artifacts."""
        table = json_safe(table_rows(rows))
        png = write_curves(rows, self.curves_path)
        episodes = f"{len(rows)} episode{'s' if len(rows) != 1 else ''}"
        markdown = (f"![curves](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
                    f"reward_mean, eval_reward_mean and kl_mean per episode of **{self.exp_name}** "
                    f"({episodes}; also `{self.curves_path}`)")
        table_about = f"per-episode metrics of {self.exp_name} ({episodes})"
        curve_about = f"reward / KL / eval curve of {self.exp_name}"
        # through api_link: while the Prefect API is away they are skipped, and the next update catches up
        if not self.ids:
            ids = {"metrics": api_link.send(create_table_artifact, key=artifact_key(self.exp_name, "metrics"),
                                            table=table, description=table_about),
                   "curves": api_link.send(create_markdown_artifact, key=artifact_key(self.exp_name, "curves"),
                                           markdown=markdown, description=curve_about)}
            if all(ids.values()):
                self.ids.update(ids)
            return
        api_link.send(self._update, "metrics", json.dumps(table), table_about)
        api_link.send(self._update, "curves", markdown, curve_about)

    def _update(self, what: str, data: str, description: str) -> None:
        # a table's data is its rows as a JSON string, a markdown artifact's the markdown (as Prefect creates them)
        with get_client(sync_client=True) as client:
            client.update_artifact(self.ids[what], ArtifactUpdate(data=data, description=description))
