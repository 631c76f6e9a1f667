"""Prompt records from JSONL or JSON files, with errors that name the file and line (the other formats:
`chatlearn.data.tables`; every format through `chatlearn.data.records.read_records`).

Whatever a file holds (any bytes, a BOM, invalid UTF-8, JSON nested too deeply, an integer too long to
convert, huge lines) gives records or a :class:`DataError` naming the file (and the line where there is one),
never another exception: the error is read before anything starts, so it must say where to look and must not
print the offending data (a line can be megabytes long).
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chatlearn.data.chat import message_problem
from chatlearn.data.errors import DataError

__all__ = ["DataError", "load_placed_records", "read_json_records"]

_BOM = b"\xef\xbb\xbf"
_JSON_SPACE = " \t\r"  # what may surround a JSONL record besides the newline (str.strip() takes more)


def load_placed_records(paths: str | Sequence[str], required_key: str | Sequence[str] | None = None,
                        chat_key: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The records of JSONL or JSON files, each with its place: ``"file:line"`` (JSONL) or ``"file: record i"``
    (JSON), so later checks (e.g. prompt length, :mod:`chatlearn.data.preflight`) can name it too. The field
    ``chat_key`` (the prompt) may hold a list of chat messages instead of a string."""
    if isinstance(paths, str | Path):
        paths = [str(paths)]
    records: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        records.extend(read_json_records(str(path), required_key, chat_key))
    if not records:
        names = ", ".join(map(str, paths)) or "no prompt file given"
        raise DataError(f"{names}: no records (empty, or blank lines only)")
    return records


def read_json_records(path: str, required_key: str | Sequence[str] | None = None,
                      chat_key: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The placed records of one JSONL or JSON file (``.json``: one list; any other name: JSONL), none when it is
    empty."""
    text = _read_text(path)
    if Path(path).suffix == ".json":
        return _json_records(path, text, required_key, chat_key)
    return _jsonl_records(path, text, required_key, chat_key)


def _read_text(path: str) -> str:
    """The file as text: UTF-8, a leading UTF-8 BOM dropped (editors on Windows add one). Invalid UTF-8 is
    an error at its line and column that shows the byte, never the file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: prompt file not found")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the prompt file: {exc.strerror or exc}") from exc
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {column} of the line is 0x{data[exc.start]:02x}: "
                        f"{exc.reason}); save the file as UTF-8") from None


def _parse(text: str) -> Any:
    """`json.loads`, every way it can fail turned into a short reason (a JSONDecodeError is kept)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ValueError(str(exc).split(";")[0]) from None


def _parse_at(text: str, where: str, whole_file: bool = False) -> Any:
    """`_parse`, with a DataError naming ``where`` (and, for a whole .json file, the line of the error)."""
    try:
        return _parse(text)
    except json.JSONDecodeError as exc:
        place = f"{where}:{exc.lineno}" if whole_file else where
        raise DataError(f"{place}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    except ValueError as exc:
        raise DataError(f"{where}: invalid JSON: {exc}") from None


def _json_records(path: str, text: str, keys: str | Sequence[str] | None,
                  chat_key: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    data = _parse_at(text, path, whole_file=True)
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json prompt file must hold a list of records, it holds a {type(data).__name__}")
    out = []
    for i, rec in enumerate(data):
        where = f"{path}: record {i}"
        if not isinstance(rec, dict):
            raise DataError(f"{where} is not an object, it is a {type(rec).__name__}")
        _check_key(rec, keys, where, chat_key)
        out.append((where, rec))
    return out


def _jsonl_records(path: str, text: str, keys: str | Sequence[str] | None,
                   chat_key: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    out = []
    # "\n" only: str.splitlines() would also split at characters a JSON string may hold raw (U+2028, \x1c, ...)
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip(_JSON_SPACE):
            continue
        where = f"{path}:{lineno}"
        rec = _parse_at(line, where)
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        _check_key(rec, keys, where, chat_key)
        out.append((where, rec))
    return out


def _check_key(rec: dict[str, Any], keys: str | Sequence[str] | None, where: str, chat_key: str | None = None) -> None:
    for key in [keys] if isinstance(keys, str) else keys or []:
        value = rec.get(key)
        if key == chat_key and isinstance(value, list):
            _check_messages(value, key, where)
            continue
        if not isinstance(value, str):
            found = "missing" if key not in rec else f"a {type(value).__name__}"
            raise DataError(f"{where}: field {key!r} must be a string, it is {found}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON's "\ud800" escape: valid JSON, but no tokenizer takes it
            raise DataError(f"{where}: field {key!r} holds an unpaired surrogate "
                            f"(\\u{ord(value[exc.start]):04x} at character {exc.start}), not text") from None


def _check_messages(value: list[Any], key: str, where: str) -> None:
    """A prompt given as chat messages: well formed, and text a tokenizer takes (as a string field must be)."""
    problem = message_problem(value)
    if problem is not None:
        raise DataError(f"{where}: field {key!r} must be a string or a list of chat messages, it is {problem}")
    for i, msg in enumerate(value):
        for field in ("role", "content"):
            try:
                msg[field].encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(f"{where}: field {key!r}, message {i}: {field!r} holds an unpaired surrogate, "
                                "not text") from None
