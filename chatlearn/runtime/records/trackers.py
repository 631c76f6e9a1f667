"""Experiment trackers (`runtime.log_args_dict`): TensorBoard, Weights & Biases and MLflow get every per-episode
metric, with the episode (counted from 1, as on the terminal and in the UI) as the step, and the resolved config
as the run's parameters; and each episode's samples (`runtime.trace_samples`): a wandb Table, an MLflow table
artifact (``traces/episode_NNNNNN.json``), a TensorBoard text table of the ones that explain the episode.

Trackers never cost the training: one that is enabled but not installed (they are the package's `trackers`
extra), unreachable, or that fails at any point costs one warning and is left out for the rest of the run.

A resumed run continues the same tracker runs. The wandb and MLflow run ids are kept in `run_dir/trackers.json`
with the last step each tracker took. Episodes a crashed run logged after its last checkpoint run again with the
same values (resume is exact), so wandb and MLflow skip steps they already have and TensorBoard purges them
(its writer's ``purge_step``).
"""

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from chatlearn.config import ChatLearnConfig
from chatlearn.config.runtime import LogArgsConfig
from chatlearn.runtime.records.traces import explaining

STATE_FILE = "trackers.json"
# MLflow's limits per request and per parameter value
_MLFLOW_BATCH_PARAMS = 100
_MLFLOW_BATCH_METRICS = 1000
_MLFLOW_PARAM_CHARS = 6000

logger = logging.getLogger("chatlearn")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, nested dicts flattened with "/" (``stage_seconds/generate``); the episode
    (the step), text and lists are left out."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, bool | int | float) and prefix != "episode":
            out[prefix] = float(value)

    walk("", row)
    return out


def flat_params(tree: Any, prefix: str = "") -> dict[str, str]:
    """A config as dotted keys and text values (``runtime.seed`` -> ``"42"``), as MLflow stores parameters."""
    if isinstance(tree, dict) and tree:
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(flat_params(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    text = tree if isinstance(tree, str) else json.dumps(tree, default=str)
    return {prefix: text[:_MLFLOW_PARAM_CHARS]}


class _Tracker(Protocol):
    name: str
    link: str

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self, failed: bool) -> None: ...


class _Start(NamedTuple):
    """What every tracker starts from."""

    logs: LogArgsConfig
    log_dir: Path  # where its files go by default
    config: dict[str, Any]  # the resolved config, the run's parameters
    exp_name: str
    state: dict[str, Any]  # trackers.json's: a tracker keeps there the run id a resume continues
    first_step: int  # the first episode it logs, from 1


# the trackers by name: ``runtime.log_args_dict.enable_<name>`` turns one on (LogArgsConfig.enabled)
TRACKERS: dict[str, type] = {}


def _tracker(cls: type) -> type:
    TRACKERS[cls.name] = cls
    return cls


@_tracker
class _TensorBoard:
    name = "tensorboard"

    def __init__(self, start: _Start):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        logs, log_dir, config, first_step = start.logs, start.log_dir, start.config, start.first_step

        path = Path(logs.tensorboard_dir or log_dir / "tensorboard")
        # purge_step: a resumed run's re-run episodes replace what the crashed run wrote for them
        self.writer = SummaryWriter(log_dir=str(path), purge_step=first_step if first_step > 1 else None)
        self.seed = int(config.get("runtime", {}).get("seed", 0))
        if first_step <= 1:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)
        self.link = f"tensorboard --logdir {path}"

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The samples that explain the episode, as a text table (TensorBoard's TEXT tab renders markdown)."""
        shown = explaining(rows, self.seed)
        cols = list(shown[0]) if shown else []
        cell = (lambda v: str(v).replace("|", "\\|").replace("\n", " "))  # noqa: E731
        table = "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
                            *("| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in shown)])
        self.writer.add_text("samples", table, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


@_tracker
class _Wandb:
    name = "wandb"

    def __init__(self, start: _Start):
        import wandb  # the trackers extra: optional, and slow to import

        logs, log_dir, config, exp_name, state = start.logs, start.log_dir, start.config, start.exp_name, start.state

        path = Path(logs.wandb_dir or log_dir / "wandb")
        path.mkdir(parents=True, exist_ok=True)
        run_id = logs.wandb_id or state.get("wandb_id") or uuid.uuid4().hex[:12]
        # quiet, and the console left alone: the terminal is the progress bar's; wandb's own log is in its dir
        self.run = wandb.init(dir=str(path), project=logs.wandb_project or exp_name, id=run_id,
                              name=logs.wandb_name or exp_name, resume=logs.wandb_resume, config=config,
                              reinit="create_new", settings=wandb.Settings(silent=True, console="off"))
        state["wandb_id"] = self.run.id
        # (the URL of an offline run is a warning on the terminal, not a link)
        self.link = (f"{self.run.dir} (offline: wandb sync {Path(self.run.dir).parent})" if self.run.offline
                     else self.run.url)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Every sample of the episode, as a wandb Table at its step."""
        import wandb  # imported when the tracker started

        cols = _columns(rows)
        self.run.log({"samples": wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])},
                     step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


@_tracker
class _Mlflow:
    name = "mlflow"

    def __init__(self, start: _Start):
        logs, config, exp_name, state = start.logs, start.config, start.exp_name, start.state
        # an unreachable server fails within seconds, not after MLflow's minutes of retries (the user's own
        # settings of these win)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # the run's summary has the link
        import mlflow
        from mlflow.entities import Param

        uri = logs.mlflow_tracking_uri or mlflow.get_tracking_uri()
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        run_id = state.get("mlflow_run_id") if state.get("mlflow_tracking_uri") == uri else None
        if run_id is not None:
            run = self.client.get_run(run_id)
            known = run.data.params
            self.client.update_run(run_id, status="RUNNING")  # the crashed or stopped run left it FAILED
        else:
            name = logs.mlflow_experiment_name or exp_name
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run = self.client.create_run(experiment_id, run_name=exp_name)
            known = {}
        self.run_id = run.info.run_id
        state.update(mlflow_run_id=self.run_id, mlflow_tracking_uri=uri)
        # a resumed run adds what its config has new; values it changed (resume_with_changes) stay as first
        # logged: MLflow refuses to change a parameter, and run_config.json records the change
        params = [Param(k, v) for k, v in flat_params(config).items() if k not in known]
        for i in range(0, len(params), _MLFLOW_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=params[i:i + _MLFLOW_BATCH_PARAMS])
        base = uri.rstrip("/")
        self.link = (f"{base}/#/experiments/{run.info.experiment_id}/runs/{self.run_id}"
                     if base.startswith("http") else f"{base} run {self.run_id}")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric  # the trackers extra (imported when the tracker started)

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_BATCH_METRICS])

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Every sample of the episode, as a table artifact of the run (MLflow's log_table)."""
        cols = _columns(rows)
        self.client.log_table(self.run_id, data={c: [r.get(c) for r in rows] for c in cols},
                              artifact_file=f"traces/episode_{step:06d}.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every column of the rows, in the order they first appear."""
    return list(dict.fromkeys(k for r in rows for k in r))


class Trackers:
    """The run's enabled trackers. `log` sends one metrics row; a tracker that raises is warned about once and
    dropped, so none of this can stop the training."""

    def __init__(self, run_dir: Path, trackers: list[_Tracker], state: dict[str, Any]):
        self.run_dir = run_dir
        self.trackers = trackers
        self.state = state

    @classmethod
    def open(cls, cfg: ChatLearnConfig, run_dir: str | os.PathLike, first_episode: int = 0) -> "Trackers":
        """The trackers `runtime.log_args_dict` enables, continuing the run directory's tracker runs when
        `first_episode` > 0 (a resume)."""
        run_dir = Path(run_dir)
        logs = cfg.runtime.log_args_dict
        if not logs.enabled:
            return cls(run_dir, [], {})
        state = _read_state(run_dir) if first_episode > 0 else {}
        start = _Start(logs, Path(logs.log_dir or run_dir), cfg.model_dump(mode="json"), cfg.runtime.exp_name, state,
                       first_episode + 1)
        out = cls(run_dir, [], state)
        for name in logs.enabled:
            try:
                out.trackers.append(TRACKERS[name](start))
            except Exception as exc:  # noqa: BLE001 - any failure of a tracker is a warning, never the run's
                _warn(name, "could not start", exc)
        out._save()
        return out

    @property
    def links(self) -> dict[str, str]:
        """Where to look at each tracker's run (a URL, or the command that opens it)."""
        return {t.name: t.link for t in self.trackers}

    def log(self, row: dict[str, Any], samples: list[dict[str, Any]] | None = None) -> None:
        """One episode's row (`metrics.jsonl`'s), its episode (from 1) the step, and its trace rows
        (`chatlearn.runtime.records.traces`: a table to the trackers that take tables); steps a tracker already
        has are skipped."""
        step = int(row["episode"])
        values = scalars(row)
        for tracker in list(self.trackers):
            key = f"{tracker.name}_step"
            logged = step <= self.state.get(key, 0)  # by the run this one resumes, with the same values
            if tracker.name != "tensorboard" and logged:
                continue
            try:
                tracker.log(step, values)
                if samples and not logged:  # TensorBoard's purge_step drops scalars logged again, not its text
                    tracker.samples(step, samples)
                self.state[key] = step
            except Exception as exc:  # noqa: BLE001
                _warn(tracker.name, f"failed at episode {step}", exc)
                self.trackers.remove(tracker)
        self._save()

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as exc:  # noqa: BLE001
                _warn(tracker.name, "could not be closed", exc)
        self.trackers = []

    def _save(self) -> None:
        if not self.state:
            return
        path = self.run_dir / STATE_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.state, indent=1))
            os.replace(tmp, path)
        except OSError as exc:
            _warn("trackers", f"state could not be written to {path}", exc)


def _read_state(run_dir: Path) -> dict[str, Any]:
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _warn(name: str, what: str, exc: BaseException) -> None:
    hint = (" (install the trackers extra: pip install 'chatlearn-prefect[trackers]')"
            if isinstance(exc, ImportError) else "")
    logger.warning("experiment tracker %s %s: %s: %s%s; the run goes on without it", name, what,
                   type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", hint)
