"""Everything a run writes about its episodes, behind `record`, `commit` and `close`.

`record` writes an episode's metrics where a user looks: the terminal and ``metrics.jsonl`` (`EpisodeReporter`),
the experiment trackers (`Trackers`), and the Prefect UI (the metrics table and curve, the progress bar).
`commit` writes the data checkpoint record that makes the episode's model checkpoints the restart point (after
its row, so a crash in between re-runs the episode and writes its row again: `chatlearn.checkpoint.resume`).
`finish` writes the run's summary; `close` closes what is open, the run failed or not. An episode's samples
go to its trace table with its row (`chatlearn.runtime.records.traces`); its completion and a stall are Prefect
events (`chatlearn.runtime.records.events`).
"""

import json
import sys
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.context import FlowRunContext

from chatlearn.checkpoint.data_checkpoint import DataCheckpointStore
from chatlearn.checkpoint.resume import commit_data_checkpoint
from chatlearn.checkpoint.run_config import record_progress
from chatlearn.config import ChatLearnConfig
from chatlearn.config.alerts import ALERT, Alert, Alerts
from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.records.events import COMPLETED, STALLED, StallWatch, emit, related_runs, run_resource
from chatlearn.runtime.records.reporting import (
    EpisodeReporter,
    RunArtifacts,
    flow_run_url,
    json_safe,
    run_summary,
    user_row,
)
from chatlearn.runtime.records.traces import drop_traces_after, write_trace
from chatlearn.runtime.records.trackers import Trackers
from chatlearn.utils.storage import writing

__all__ = ["RunRecorder"]


class RunRecorder:
    """The records of one start of a run, from episode ``first`` (0-based) on. ``startup_seconds`` goes with the
    first episode's row; ``data_checkpoint_path`` is where `commit` writes."""

    def __init__(self, cfg: ChatLearnConfig, run_dir: Path, first: int, data_checkpoint_path: str,
                 startup_seconds: float = 0.0) -> None:
        rt = cfg.runtime
        self.cfg, self.run_dir, self.first, self.startup_seconds = cfg, run_dir, first, startup_seconds
        self.store = DataCheckpointStore(data_checkpoint_path)
        self.reporter = EpisodeReporter(cfg, run_dir, first_episode=first)
        drop_traces_after(run_dir, first)  # as the reporter cuts the rows of the episodes that run again
        self.trackers = Trackers.open(cfg, run_dir, first_episode=first)  # runtime.log_args_dict
        self.ui = flow_run_url()
        if self.ui:  # Prefect's own "View at" line is in the log file (chatlearn.runtime.records.console)
            sys.stderr.write(f"Prefect flow run: {self.ui}\n")
        self.tracker_links = dict(self.trackers.links)  # for the summary
        for name, link in self.tracker_links.items():
            sys.stderr.write(f"{name}: {link}\n")
        self.artifacts = RunArtifacts(rt.exp_name, run_dir)  # metrics table + curve: one of each per run
        self.progress_id = api_link.send(create_progress_artifact, progress=100.0 * first / max(1, rt.num_episode),
                                         key=self.reporter.artifact_key("progress"),
                                         description=f"episodes of {rt.exp_name}")
        self.last: dict[str, Any] = self.reporter.rows[-1] if self.reporter.rows else {}
        self.eval_before_training: float | None = None
        run = FlowRunContext.get()
        self.resource = run_resource(rt.exp_name, str(run_dir))
        self.related = related_runs(run.flow_run if run is not None else None)
        self.watch = StallWatch(rt.stall_factor, self._stalled, first)
        self.alerts = Alerts(rt.alerts)
        for row in self.reporter.rows:  # a resumed run: where each alert's count stood (they fired back then)
            self.alerts.update(row)

    def before_training(self, eval_reward_mean: float) -> None:
        """The eval before training (ChatLearn 1.0.3's ``enable_eval_before_training``): said now, and kept in the
        first episode's row as the baseline the eval curve starts from."""
        self.eval_before_training = eval_reward_mean
        self.reporter.write(f"eval before training: eval_reward_mean={eval_reward_mean:.4g}")

    def record(self, metrics: dict[str, Any]) -> None:
        """An episode's metrics (the episode flow's, with the runner's measurements), everywhere."""
        episode = metrics["episode"]
        if self.eval_before_training is not None and episode == 0:
            metrics["eval_reward_mean_before_training"] = self.eval_before_training
        if episode == self.first:
            metrics["startup_seconds"] = self.startup_seconds
        trace = metrics.pop("trace", None)
        if trace is not None and self.cfg.runtime.trace_samples != "none":  # its size: what a trace costs on disk
            metrics["trace_bytes"] = write_trace(self.run_dir, episode, trace)
        self.reporter.record(metrics)
        self.trackers.log(self.reporter.rows[-1], trace)
        num_episode = self.cfg.runtime.num_episode
        if self.progress_id is not None:
            api_link.post(update_progress_artifact, self.progress_id, progress=100.0 * (episode + 1) / num_episode)
        api_link.post(self.artifacts.update, list(self.reporter.rows))  # the curve is drawn there too
        self.last = user_row(metrics)
        row = self.reporter.rows[-1]
        emit(COMPLETED, self.resource, json_safe({"episode": episode + 1, "metrics": row,
                                                  "checkpoint": metrics.get("checkpoint_paths") or {}}),
             self.related)
        self.watch.episode_done(episode, float(metrics.get("episode_seconds") or 0.0))
        for alert, episodes in self.alerts.update(row):
            self._alerted(alert, episodes)

    def _alerted(self, alert: Alert, episodes: list[int]) -> None:
        """An alert met over ``episodes`` (counted from 1): one line, and its event for the automations."""
        values = [r.get(alert.metric) for r in self.reporter.rows if r["episode"] in episodes]
        sys.stderr.write(f"chatlearn: alert: {alert.text} (episodes {episodes[0]}-{episodes[-1]}: "
                         f"{', '.join(f'{v:.4g}' for v in values if v is not None)})\n")
        resource = {"prefect.resource.id": f"chatlearn.alert.{self.cfg.runtime.exp_name}.{alert.slug}",
                    "prefect.resource.name": alert.text, "chatlearn.alert": alert.text,
                    "chatlearn.run-dir": self.resource["chatlearn.run-dir"]}
        emit(ALERT, resource, json_safe({"alert": alert.text, "episodes": episodes, "values": values}),
             [{**self.resource, "prefect.resource.role": "run"}, *self.related])

    def _stalled(self, episode: int, seconds: float, median: float) -> None:
        factor = self.cfg.runtime.stall_factor
        sys.stderr.write(f"chatlearn: warning: episode {episode + 1} has run {seconds:.0f} s, more than "
                         f"{factor:g} times the median episode ({median:.1f} s; runtime.stall_factor)\n")
        emit(STALLED, self.resource, {"episode": episode + 1, "seconds": seconds, "median_seconds": median,
                                      "stall_factor": factor}, self.related)

    def commit(self, metrics: dict[str, Any]) -> str:
        """Make the episode's checkpoints the run's restart point; returns the record's path."""
        rt = self.cfg.runtime
        path = commit_data_checkpoint(self.cfg, self.store, metrics)
        record_progress(self.cfg, metrics["episode"] + 1)
        api_link.post(
            create_markdown_artifact, key=self.reporter.artifact_key("data-checkpoint"),
            markdown=f"latest data checkpoint of **{rt.exp_name}**: episode {metrics['episode'] + 1}, trainer "
                     f"iteration {metrics['iteration']}, `{path}`",
            description="where a re-run of this config resumes from",
        )
        return path

    def close(self, failed: bool) -> None:
        """Close the trackers (marking their run failed or not) and the terminal's progress bar; what was posted
        to the Prefect API is sent (or dropped) now, while Ray is still up: it holds Ray handles."""
        self.watch.close()
        self.trackers.close(failed)
        api_link.flush()
        self.reporter.close()

    def finish(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The run's result: the last episode's row, ``extra`` (e.g. the final policy's path and parameter counts)
        and the summary (`run_summary`), also written to ``summary.json``; the run is recorded as finished."""
        rt = self.cfg.runtime
        last = dict(self.last)
        last.update(extra)
        last.update(run_summary(self.reporter.rows, rt.num_episode, self.run_dir, self.tracker_links, self.ui))
        summary = self.run_dir / "summary.json"
        tmp = summary.with_suffix(".json.tmp")
        with writing("the run summary", summary, cleanup=tmp):
            tmp.write_text(json.dumps(json_safe(last), default=str, indent=1, allow_nan=False))
            tmp.replace(summary)  # never half a summary
        record_progress(self.cfg, rt.num_episode, final_policy=last.get("final_policy"), finished=True)
        return last
