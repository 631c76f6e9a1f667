"""A run's data records as one lazy, indexable sequence, whatever the files' formats.

`read_records` reads ``runtime.data_path`` / ``eval_data_path`` (one path or a list): JSONL and JSON files into
memory as before (`chatlearn.data.prompts`), parquet, Arrow, CSV and ``save_to_disk`` directories as
memory-mapped Arrow tables (`chatlearn.data.tables`). `Records` joins them: ``len()`` and ``records[i]`` (a dict)
are all the pipeline asks, so only the rows an episode uses are ever turned into Python objects, on the driver
and on the actor that holds the dataset alike.

Two things change a record's prompt on the way out, both decided on the driver before the run starts
(`chatlearn.data.preflight`): a prompt given as chat messages is rendered with the model's chat template
(`with_chat`), and a prompt cut to fit the model's context replaces the original (`with_cuts`, only the cut
ones are held).

Pickled (``ray.put`` to the producer's actors), a memory-mapped table travels as the paths of its Arrow files
(`datasets` pickles it so), unless it is small (`SHIP_BY_VALUE_BYTES`): then its rows travel in the object, as
JSONL records do, and no actor needs the driver's files. A large table's files must be readable where the actor
runs (one machine, or a filesystem the nodes share).
"""

import bisect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from chatlearn.data.chat import ChatTemplate, is_chat
from chatlearn.data.errors import DataError
from chatlearn.data.prompts import read_json_records
from chatlearn.data.tables import BATCH_ROWS, check_columns, is_table, open_table, scan

__all__ = ["SHIP_BY_VALUE_BYTES", "Records", "read_records"]

SHIP_BY_VALUE_BYTES = 16 << 20  # a table this small is pickled with its rows, not as paths


class _Rows:
    """Records held in memory (JSON, JSONL, or given in code), each with its place."""

    def __init__(self, placed: list[tuple[str, dict[str, Any]]]) -> None:
        self.placed = placed

    def __len__(self) -> int:
        return len(self.placed)

    def row(self, i: int) -> dict[str, Any]:
        return self.placed[i][1]

    def place(self, i: int) -> str:
        return self.placed[i][0]

    def column_batches(self, key: str) -> Iterator[list[Any]]:
        for start in range(0, len(self.placed), BATCH_ROWS):
            yield [rec[key] for _, rec in self.placed[start:start + BATCH_ROWS]]

    def is_chat(self, key: str) -> bool:
        return any(is_chat(rec.get(key)) for _, rec in self.placed)


class _Table:
    """The rows of one table file, memory-mapped (`chatlearn.data.tables`)."""

    def __init__(self, path: str, ds: Any, chat: bool = False) -> None:
        self.path, self.ds, self.chat = path, ds, chat

    def __len__(self) -> int:
        return len(self.ds)

    def row(self, i: int) -> dict[str, Any]:
        return self.ds[i]

    def place(self, i: int) -> str:
        return f"{self.path}: row {i}"

    def column_batches(self, key: str) -> Iterator[Any]:
        """A pyarrow array per batch of rows."""
        return (batch.column(key) for batch in scan(self.ds, [key]))

    def is_chat(self, key: str) -> bool:
        return self.chat

    def __reduce__(self) -> tuple[Any, ...]:
        if self.ds.data.nbytes > SHIP_BY_VALUE_BYTES:
            return _Table, (self.path, self.ds, self.chat)  # `datasets` pickles a memory-mapped table as paths
        return _table_of_arrow, (self.path, self.ds.data.table, self.chat)


def _table_of_arrow(path: str, table: Any, chat: bool) -> _Table:
    """A `_Table` over an in-memory Arrow table (one that travelled by value)."""
    # datasets: only where a table is read (its import takes about a second)
    import datasets
    from datasets.table import InMemoryTable

    # a fingerprint given: `datasets` would otherwise hash every row to make one (a copy of the table at its peak)
    fingerprint = f"chatlearn-{abs(hash((path, table.num_rows))):x}"
    return _Table(path, datasets.Dataset(InMemoryTable(table), fingerprint=fingerprint), chat)


class Records(Sequence[dict[str, Any]]):
    """The records of a run, read lazily: ``records[i]`` is the i-th record as a dict (its prompt rendered and
    cut as the preflight decided); `place` names where it came from."""

    def __init__(self, parts: Sequence[_Rows | _Table], prompt_key: str | None = None,
                 chat: ChatTemplate | None = None, cuts: Mapping[int, str] | None = None,
                 order: np.ndarray | None = None) -> None:
        self._parts = list(parts)
        self._starts = list(np.cumsum([0] + [len(p) for p in self._parts[:-1]]).tolist()) if self._parts else []
        self._total = sum(len(p) for p in self._parts)
        self.prompt_key, self.chat, self._cuts, self._order = prompt_key, chat, dict(cuts or {}), order

    @classmethod
    def of(cls, placed: list[tuple[str, dict[str, Any]]]) -> "Records":
        """Records held in memory, each with its place (records given in code, JSONL read already)."""
        return cls([_Rows(placed)])

    def __len__(self) -> int:
        return len(self._order) if self._order is not None else self._total

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        j = self._source(i)
        part, local = self._locate(j)
        rec = dict(part.row(local))
        key = self.prompt_key
        if j in self._cuts:
            rec[key] = self._cuts[j]
        elif self.chat is not None and key is not None and is_chat(rec.get(key)):
            rec[key] = self.chat.render(rec[key], part.place(local))
        return rec

    def place(self, i: int) -> str:
        """Where record ``i`` came from: ``"file:line"`` (JSONL), ``"file: record i"`` (JSON), ``"file: row i"``
        (a table)."""
        part, local = self._locate(self._source(i))
        return part.place(local)

    def _source(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"record {i} of {n}")
        i %= n
        return int(self._order[i]) if self._order is not None else i

    def _locate(self, j: int) -> tuple[_Rows | _Table, int]:
        k = bisect.bisect_right(self._starts, j) - 1
        return self._parts[k], j - self._starts[k]

    def _changed(self, **kw: Any) -> "Records":
        state = dict(prompt_key=self.prompt_key, chat=self.chat, cuts=self._cuts, order=self._order)
        return Records(self._parts, **{**state, **kw})

    def first_chat(self, key: str) -> str | None:
        """The place of the first record whose ``key`` holds chat messages (None: none does)."""
        for part in self._parts:
            if not part.is_chat(key):
                continue
            if isinstance(part, _Table):
                return part.place(0)
            return next(part.place(i) for i in range(len(part)) if is_chat(part.row(i).get(key)))
        return None

    def with_chat(self, key: str, chat: ChatTemplate) -> "Records":
        """These records with their ``key`` (the prompt) rendered with ``chat`` where it holds messages."""
        return self._changed(prompt_key=key, chat=chat)

    def with_cuts(self, key: str, cuts: Mapping[int, str]) -> "Records":
        """These records with the prompts (``key``) of rows ``cuts`` names replaced (cut to fit). Before any
        `reordered`: the rows are numbered as read."""
        if self._order is not None:
            raise ValueError("cut the prompts before reordering the records")
        return self._changed(prompt_key=key, cuts={**self._cuts, **cuts})

    def reordered(self, order: Sequence[int]) -> "Records":
        """The records in ``order`` (positions into these records), e.g. ranked by prompt length."""
        base = self._order if self._order is not None else np.arange(len(self), dtype=np.int64)
        return self._changed(order=base[np.asarray(order, dtype=np.int64)])

    def text_bytes(self, key: str) -> Iterator[np.ndarray]:
        """The UTF-8 length of ``key``'s text in every row, in order, one array per batch of rows; the prompt as
        the model reads it (rendered, cut). Never holds more than a batch: a bound for the length check that
        costs no tokenizer (`chatlearn.data.preflight`)."""
        if self._order is not None:
            raise ValueError("measure the records before reordering them")
        cut_rows = sorted(self._cuts) if key == self.prompt_key else []
        for part, start in zip(self._parts, self._starts, strict=True):
            row = start
            render = key == self.prompt_key and self.chat is not None and part.is_chat(key)
            for batch in part.column_batches(key):
                if render or isinstance(part, _Rows):
                    values = batch.to_pylist() if not isinstance(batch, list) else batch
                    texts = [self.chat.render(v, part.place(row - start + k)) if render and is_chat(v) else v
                             for k, v in enumerate(values)]
                    out = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
                else:  # a column of strings: measured by Arrow, no Python string made
                    import pyarrow.compute as pc

                    out = pc.binary_length(batch).to_numpy(zero_copy_only=False).astype(np.int64)
                lo, hi = bisect.bisect_left(cut_rows, row), bisect.bisect_left(cut_rows, row + len(out))
                for j in cut_rows[lo:hi]:
                    out[j - row] = len(self._cuts[j].encode("utf-8"))
                row += len(out)
                yield out


def read_records(paths: str | os.PathLike | Sequence[str], keys: Sequence[str] = (),
                 chat_key: str | None = None) -> Records:
    """The records of one path or a list of paths, in order: JSONL (``.jsonl`` or any other name) and JSON
    (``.json``) read into memory; parquet, Arrow (``.arrow``), CSV and ``save_to_disk`` directories memory-mapped.

    Every record must hold a string under each of ``keys``; ``chat_key`` (the prompt) may hold chat messages
    instead. A DataError names the file and line, record or row of the first problem, or the files when there
    are no records at all.
    """
    paths = [os.fspath(paths)] if isinstance(paths, str | os.PathLike) else [os.fspath(p) for p in paths]
    parts: list[_Rows | _Table] = []
    for path in paths:
        if is_table(path):
            ds = open_table(path)
            parts.append(_Table(path, ds, check_columns(ds, path, list(keys), chat_key)))
        else:
            parts.append(_Rows(read_json_records(path, list(keys), chat_key)))
    parts = [p for p in parts if len(p)]
    if not parts:
        names = ", ".join(paths) or "no prompt file given"
        raise DataError(f"{names}: no records (empty, or blank lines only)")
    return Records(parts)


def load_records(paths: str | Sequence[str], required_key: str | Sequence[str] | None = None) -> list[dict[str, Any]]:
    """All records of one path or a list of paths, in order, as a list (every format of `read_records`; a run
    reads them lazily there instead). JSONL: one object per line; JSON: a list.

    With `required_key` (one field name or several), every record must hold a string under each (e.g. the
    prompt; a DPO pair's chosen and rejected responses), checked here on the driver so the error can name the
    file and line before any actor starts.
    """
    return list(read_records(paths, [required_key] if isinstance(required_key, str) else required_key or []))
