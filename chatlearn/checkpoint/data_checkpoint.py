"""The data checkpoint: where a run stands, as a pydantic record in Prefect result storage.

Each record (episode, consumed samples, trainer iteration, RNG state, relay buffer location, model checkpoint
paths) is written through a Prefect `ResultStore` (JSON serializer) under `iter_<N>`, plus a `latest` pointer.
Records are written to a temporary key and renamed, so a crash never leaves a half-written record under a
real key; reading never uses Prefect's object decoder (which can import classes named in the file): the
file is parsed as plain JSON and validated by pydantic, and every model checkpoint it points to has its
checksums verified. A record that fails any of that is reported and skipped for the newest good one.

A record that cannot be written (disk full, read-only, a file in the way) is a `RunError` naming the record
and the OS error; its temporary file is removed and, if only the `latest` pointer failed, the new record too,
so the previous record stays the resume point and `latest`.
"""

import json
import logging
import os
import re
import shutil
from datetime import UTC, datetime
from typing import Any

from prefect.filesystems import LocalFileSystem
from prefect.results import ResultStore
from prefect.serializers import JSONSerializer
from pydantic import BaseModel, Field, ValidationError

from chatlearn.checkpoint.model_checkpoint import CheckpointError, verify_model_checkpoint
from chatlearn.utils.files import fsync_file
from chatlearn.utils.storage import os_error_text, remove_quietly, writing

logger = logging.getLogger("chatlearn.checkpoint")

RECORD_RE = re.compile(r"^iter_(\d{7,})$")
LATEST = "latest"


class DataCheckpoint(BaseModel):
    """Everything the driver needs to continue a run exactly where it stopped."""

    format_version: int = 1
    episode: int = Field(description="last completed episode (0-based)")
    consumed_samples: int = Field(description="position in the prompt stream after that episode")
    train_iteration: int = Field(description="trainer optimizer steps done")
    sample_per_episode: int
    seed: int
    rng_state: dict[str, Any] = Field(default_factory=dict, description="driver RNG states (python, torch)")
    relay_path: str | None = Field(None, description="relay buffer checkpoint directory, when relay is on")
    model_checkpoints: dict[str, str] = Field(default_factory=dict, description="model name -> checkpoint dir")
    policy_versions: dict[int, str] = Field(default_factory=dict, description="pipelined episodes: the older policy "
                                            "weights the next episodes generate on, version -> file")
    partial_rollouts: str | None = Field(None, description="partial rollouts: the responses in flight (unfinished, "
                                         "and finished ones waiting for their group), directory")
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())


class DataCheckpointStore:
    """Data checkpoint records under one directory (`runtime.data_checkpoint_path`)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)

    def _store(self) -> ResultStore:
        return ResultStore(result_storage=LocalFileSystem(basepath=self.path), serializer=JSONSerializer())

    @staticmethod
    def key(iteration: int) -> str:
        return f"iter_{iteration:07d}"

    def write(self, record: DataCheckpoint, crash_hook=None) -> str:
        """Write `record` atomically, then point `latest` at it. Returns the record's file path.

        A failed write raises `RunError` ("cannot write data checkpoint to <file>: [Errno 28] ...") and
        leaves the previous record the newest and `latest`."""
        key = self.key(record.train_iteration)
        file = os.path.join(self.path, key)
        with writing("data checkpoint", file, cleanup=file + ".tmp"):
            os.makedirs(self.path, exist_ok=True)
            store = self._store()
            store.write(record.model_dump(mode="json"), key=key + ".tmp")
            if crash_hook is not None:
                crash_hook()
            fsync_file(file + ".tmp")
            os.replace(file + ".tmp", file)
        latest = os.path.join(self.path, LATEST)
        try:
            with writing("data checkpoint", latest, cleanup=latest + ".tmp"):
                store.write({"key": key, "episode": record.episode, "train_iteration": record.train_iteration},
                            key=LATEST + ".tmp")
                os.replace(latest + ".tmp", latest)
        except BaseException:
            remove_quietly(file)  # resume reads the newest record: without a `latest` it must not be there
            raise
        return file

    def iterations(self) -> list[int]:
        """Train iterations of the records present, oldest first."""
        if not os.path.isdir(self.path):
            return []
        its = [int(m.group(1)) for name in os.listdir(self.path) if (m := RECORD_RE.match(name))]
        return sorted(its)

    def read(self, iteration: int) -> DataCheckpoint:
        """One record, fully checked (JSON, schema, and the model checkpoints it names); CheckpointError if bad."""
        file = os.path.join(self.path, self.key(iteration))
        try:
            with open(file) as f:
                outer = json.load(f)
            serializer = outer["metadata"]["serializer"]["type"]
            if serializer != "json":
                raise CheckpointError(f"{file}: serializer {serializer!r} refused (only json is read)")
            record = DataCheckpoint.model_validate(json.loads(outer["result"]))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{file}: no such data checkpoint") from exc
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            raise CheckpointError(f"{file}: unreadable data checkpoint: {exc}") from exc
        for name, path in record.model_checkpoints.items():
            try:
                verify_model_checkpoint(path)
            except CheckpointError as exc:
                raise CheckpointError(f"{file}: model checkpoint of {name!r} is bad: {exc}") from exc
        if record.relay_path is not None and not os.path.isfile(os.path.join(record.relay_path, "relay.json")):
            raise CheckpointError(f"{file}: relay buffer checkpoint {record.relay_path} is missing")
        return record

    def latest_good(self) -> DataCheckpoint | None:
        """The newest record that passes every check; bad ones are logged and skipped."""
        for iteration in reversed(self.iterations()):
            try:
                return self.read(iteration)
            except CheckpointError as exc:
                logger.warning("skipping data checkpoint: %s", exc)
        return None

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` records, and the checkpoint files only they referenced."""
        its = self.iterations()
        drop, kept = its[:-keep] if keep > 0 else [], its[-keep:] if keep > 0 else its
        referenced: set[str] = set()
        for it in kept:
            try:
                rec = self.read(it)
            except CheckpointError:
                continue
            referenced.update(_directories(rec))
        for it in drop:
            file = os.path.join(self.path, self.key(it))
            try:
                rec = self.read(it)
                for path in _directories(rec):
                    if path not in referenced:
                        shutil.rmtree(path, ignore_errors=True)
            except CheckpointError:
                pass
            try:
                os.remove(file)
            except OSError as exc:  # housekeeping: the run goes on (a write there would fail on its own)
                logger.warning("could not remove the old data checkpoint %s: %s", file, os_error_text(exc))
        return drop


def _directories(rec: DataCheckpoint) -> set[str]:
    """The checkpoint directories a record refers to (a policy version is a file in a directory of its own)."""
    paths = {*rec.model_checkpoints.values(), rec.relay_path, rec.partial_rollouts,
             *(os.path.dirname(p) for p in rec.policy_versions.values())}
    return {p for p in paths if p}
