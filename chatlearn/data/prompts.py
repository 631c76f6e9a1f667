"""Prompt records from JSONL or JSON files, with errors that name the file and line."""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file (and line)."""


def load_records(paths: str | Sequence[str], required_key: str | Sequence[str] | None = None) -> list[dict[str, Any]]:
    """All records of one path or a list of paths, in order. JSONL: one object per line; JSON: a list.

    With `required_key` (one field name or several), every record must hold a string under each (e.g. the
    prompt; a DPO pair's chosen and rejected responses), checked here on the driver so the error can name the
    file and line before any actor starts.
    """
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
                _check_key(rec, required_key, f"{path}: record {i}")
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
            _check_key(rec, required_key, f"{path}:{lineno}")
            records.append(rec)
    if not records:
        raise DataError(f"{', '.join(map(str, paths))}: no records")
    return records


def _check_key(rec: dict[str, Any], keys: str | Sequence[str] | None, where: str) -> None:
    for key in [keys] if isinstance(keys, str) else keys or []:
        if not isinstance(rec.get(key), str):
            found = "missing" if key not in rec else f"a {type(rec[key]).__name__}"
            raise DataError(f"{where}: field {key!r} must be a string, it is {found}")
