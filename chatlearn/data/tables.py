"""Table files read with Hugging Face `datasets`: parquet, Arrow, CSV, or a directory `save_to_disk` wrote.

A file is opened as a memory-mapped Arrow table (`datasets` converts parquet, CSV and Arrow IPC files once into
its cache, ``HF_DATASETS_CACHE``, parquet in record batches of about `BATCH_BYTES`; a ``save_to_disk``
directory is mapped where it is), so nothing holds the whole file in memory: a row is read when it is asked
for. The checks of a record's fields run over the columns batch by batch (`scan`), and a problem is one
:class:`~chatlearn.data.prompts.DataError` naming the file and the row (``"file: row 17"``, counted from 0 as
``dataset[17]``).

A prompt column holds strings, or chat messages: a list of ``{role, content}`` structs (rendered later with the
model's chat template, `chatlearn.data.chat`).
"""

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from chatlearn.data.errors import DataError

__all__ = ["BATCH_BYTES", "BATCH_ROWS", "TABLE_FORMATS", "check_columns", "is_table", "open_table", "scan"]

TABLE_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
BATCH_ROWS = 1000  # rows measured at once where a table's own batches are not used
# bytes of one record batch converted from parquet: what a conversion or a scan holds at once; and few batch
# headers, which a memory map's readers touch (each fault maps 64 KB around it, counted in the process's RSS)
BATCH_BYTES = 4 << 20
CONVERT_APART_BYTES = 1 << 20  # a larger file is converted into the cache in a child process (`_converted`)


def is_table(path: str) -> bool:
    """Whether ``path`` is read as a table: a parquet, Arrow or CSV file, or a ``save_to_disk`` directory."""
    return Path(path).suffix.lower() in TABLE_FORMATS or os.path.isdir(path)


def open_table(path: str) -> Any:
    """The ``datasets.Dataset`` of ``path``, memory-mapped; a DataError naming the file when it cannot be read."""
    import datasets  # on demand: commands that never read data stay fast

    if not os.path.exists(path):
        raise DataError(f"{path}: data file not found")
    try:
        if os.path.isdir(path):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if len(ds) != 1:
                    raise DataError(f"{path}: a DatasetDict of splits {sorted(ds)}; name one split's directory "
                                    f"(e.g. {os.path.join(path, sorted(ds)[0])})")
                ds = next(iter(ds.values()))
        else:
            ds = _converted(TABLE_FORMATS[Path(path).suffix.lower()], os.path.abspath(path))
    except DataError:
        raise
    except Exception as exc:  # pyarrow, datasets and OS errors alike: one line naming the file
        raise DataError(f"{path}: cannot read it as {_kind(path)}: {_reason(exc)}") from None
    if getattr(ds, "_indices", None) is not None:  # a selection saved without its rows: rows in their order
        ds = ds.flatten_indices()
    return ds


def _converted(builder: str, path: str) -> Any:
    """The file as `datasets` caches it. The first time, a file over `CONVERT_APART_BYTES` is converted in a
    child process: Arrow's parquet reader holds memory in proportion to the file while it converts (measured:
    +44 MB peak for a 21 MB file of a million short rows, whatever the batch size), and the driver must not;
    the child fails alike on a bad file, and then this process's own call names the error."""
    # datasets: only where a table is read (its import takes about a second)
    import datasets
    from datasets.table import InMemoryTable

    options = _options(builder, path)
    if builder == "parquet" and "batch_size" not in options and _parquet_rows(path) == 0:
        # `datasets` refuses a split of no rows; an empty file is "no records", said by the caller
        return datasets.Dataset(InMemoryTable(_parquet_schema(path).empty_table()), fingerprint="chatlearn-empty")
    prepared = datasets.load_dataset_builder(builder, data_files=path, **options)
    cached = os.path.isfile(os.path.join(prepared.cache_dir, "dataset_info.json"))
    if not cached and os.path.getsize(path) > CONVERT_APART_BYTES:
        subprocess.run([sys.executable, "-c", _CONVERT, builder, path, json.dumps(options)], env=os.environ.copy(),
                       stdin=subprocess.DEVNULL, capture_output=True, check=False)
    return datasets.load_dataset(builder, data_files=path, split="train", **options)


# what the child runs: the same call, so this process then finds the cache it wrote
_CONVERT = ("import json, sys, datasets; "
            "datasets.load_dataset(sys.argv[1], data_files=sys.argv[2], split='train', **json.loads(sys.argv[3]))")


def _options(builder: str, path: str) -> dict[str, Any]:
    """A parquet file is converted in record batches of about `BATCH_BYTES` (`datasets` would take a whole row
    group at once, often the whole file, and write batches of 1000 rows, whose many headers a memory map's
    readers touch)."""
    if builder != "parquet":
        return {}
    import pyarrow.parquet as pq  # parquet files only

    try:
        meta = pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException):
        return {}  # `datasets` says what is wrong with it
    if not meta.num_rows:
        return {}
    row_bytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) / max(meta.num_rows, 1)
    rows = int(min(max(BATCH_BYTES // max(row_bytes, 1), 100), 100_000))
    return {"batch_size": rows, "writer_batch_size": rows}


def _parquet_rows(path: str) -> int | None:
    import pyarrow.parquet as pq  # parquet files only

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException):
        return None


def _parquet_schema(path: str) -> pa.Schema:
    import pyarrow.parquet as pq  # parquet files only

    return pq.read_schema(path)


def _kind(path: str) -> str:
    return "a datasets directory (save_to_disk)" if os.path.isdir(path) else TABLE_FORMATS[Path(path).suffix.lower()]


def _reason(exc: BaseException) -> str:
    """The first line of the innermost cause (`datasets` wraps the reader's error in its own)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def scan(ds: Any, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """The ``columns`` of every row, in record batches, in order.

    Read from the cache files with ordinary reads, a batch at a time: through the memory map, every page a
    whole-column pass touches would stay resident in this process (file-backed, but counted in its RSS).
    """
    files = [f["filename"] for f in ds.cache_files]
    if not files or not all(_is_stream(f) for f in files):
        yield from (b.select(list(columns)) for b in ds.data.table.to_batches(max_chunksize=BATCH_ROWS))
        return
    rows = 0
    for name in files:
        with pa.OSFile(name) as f:
            for batch in pa.ipc.open_stream(f):
                rows += batch.num_rows
                yield batch.select(list(columns))
    if rows != len(ds):  # never seen: the cache files are the table, block after block
        raise RuntimeError(f"scanned {rows} rows of {files}, the table has {len(ds)}")


def _is_stream(name: str) -> bool:
    try:
        with pa.OSFile(name) as f:
            pa.ipc.open_stream(f)
        return True
    except (OSError, pa.ArrowInvalid):
        return False


def _string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _chat_type(t: pa.DataType) -> bool:
    """A list of structs with string ``role`` and ``content``: chat messages."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    fields = {t.value_type.field(i).name: t.value_type.field(i).type for i in range(t.value_type.num_fields)}
    return all(name in fields and _string(fields[name]) for name in ("role", "content"))


def check_columns(ds: Any, path: str, keys: Sequence[str], chat_key: str | None = None) -> bool:
    """Every key a column of strings without a missing value; ``chat_key`` (the prompt) may be chat messages
    instead. A DataError names the file and the first bad row. Returns whether ``chat_key`` holds messages."""
    schema = ds.data.schema
    for key in keys:
        if key not in schema.names:
            raise DataError(f"{path}: no column {key!r} (its columns: {', '.join(schema.names) or 'none'})")
        t = schema.field(key).type
        if not _string(t) and not (key == chat_key and _chat_type(t)):
            what = "a string or a list of chat messages" if key == chat_key else "a string"
            raise DataError(f"{path}: row 0: field {key!r} must be {what}, it is a {t} (the column's type)")
    chat = chat_key is not None and chat_key in keys and _chat_type(schema.field(chat_key).type)
    if not keys or not len(ds):
        return chat
    start = 0
    for batch in scan(ds, list(keys)):
        for key in keys:
            problem = _first_problem(batch.column(key), key == chat_key and chat)
            if problem is not None:
                row, what = problem
                kind = "a list of chat messages" if key == chat_key and chat else "a string"
                raise DataError(f"{path}: row {start + row}: field {key!r} must be {kind}, it is {what}")
        start += batch.num_rows
    return chat


def _first_problem(col: pa.Array, chat: bool) -> tuple[int, str] | None:
    """(row, what it is) of the first value of ``col`` that is missing, or for chat an empty list or a message
    without its role or content; None when all are good."""
    rows = []
    if col.null_count:
        rows.append((_first_true(col.is_null()), "missing"))
    if chat:
        lengths = pc.list_value_length(col)
        empty = pc.fill_null(pc.equal(lengths, 0), False)
        if pc.any(empty).as_py():
            rows.append((_first_true(empty), "an empty list of chat messages"))
        messages = pc.list_flatten(col)
        parents = pc.list_parent_indices(col)
        for field in ("role", "content"):
            values = pc.struct_field(messages, field)
            missing = pc.or_(values.is_null(), messages.is_null())
            if pc.any(missing).as_py():
                at = _first_true(missing)
                rows.append((parents[at].as_py(), f"a list whose message {at - _first_message(parents, at)} has "
                                                  f"no {field!r}"))
    return min(rows) if rows else None


def _first_true(mask: pa.Array) -> int:
    return pc.index(mask, True).as_py()


def _first_message(parents: pa.Array, at: int) -> int:
    """The flat index of the first message of the row that message ``at`` belongs to."""
    return pc.index(parents, parents[at]).as_py()
