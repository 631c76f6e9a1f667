"""Prompt records from JSONL or JSON files, with errors that name the file and line."""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file (and line)."""


def load_records(paths: str | Sequence[str]) -> list[dict[str, Any]]:
    """All records of one path or a list of paths, in order. JSONL: one object per line; JSON: a list."""
    if isinstance(paths, str | Path):
        paths = [str(paths)]
    records: list[dict[str, Any]] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"{path}: prompt file not found")
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
            if not isinstance(data, list):
                raise DataError(f"{path}: a .json prompt file must hold a list of records")
            for i, rec in enumerate(data):
                if not isinstance(rec, dict):
                    raise DataError(f"{path}: record {i} is not an object")
            records.extend(data)
            continue
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from exc
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            records.append(rec)
    if not records:
        raise DataError(f"{', '.join(map(str, paths))}: no records")
    return records
