"""Property-based tests of the prompt reader (`chatlearn.data.records.load_records`).

Whatever a file holds (random bytes, random JSON values per line, random .json documents, invalid UTF-8,
BOMs, empty files, huge lines, deep nesting) the reader returns records or raises a DataError that names the
file (and the line where there is one) in a short message, never another exception and never the file's
contents: the error is read on a terminal before anything starts.
"""

import codecs
import json
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chatlearn.data.prompts import DataError
from chatlearn.data.records import load_records

# no example database: nothing written into the working tree, every run draws afresh (seeded by hypothesis)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
MAX_MESSAGE = 400  # besides the path: a message says where and why, never what the file holds

_DIR = Path(tempfile.mkdtemp(prefix="fuzz-data-"))
_count = iter(range(10**9))


def write(content: bytes, suffix: str) -> Path:
    path = _DIR / f"f{next(_count)}{suffix}"
    path.write_bytes(content)
    return path


def read(path: Path, key: str | None = None) -> list[dict] | DataError:
    """The records, or the DataError after checking it names the place (anything else fails the test)."""
    try:
        records = load_records(str(path), key)
    except DataError as exc:
        msg = str(exc)
        assert msg.startswith(f"{path}:"), msg
        assert len(msg) <= len(str(path)) + MAX_MESSAGE, msg[:500]
        return exc
    assert records and all(isinstance(r, dict) for r in records)
    if key is not None:
        assert all(isinstance(r[key], str) for r in records)
    return records


def line_of(err: DataError, path: Path) -> int | None:
    """The line a DataError names (None: the file as a whole, or a record of a .json list)."""
    m = re.match(re.escape(str(path)) + r":(\d+): ", str(err))
    return int(m.group(1)) if m else None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
records = st.dictionaries(st.sampled_from(["prompt", "answer", "chosen", "x"]), json_values, max_size=4)
suffixes = st.sampled_from([".jsonl", ".json", ".txt"])


@FAST
@given(content=st.binary(max_size=2000), suffix=suffixes, key=st.sampled_from([None, "prompt"]))
@example(content=b"", suffix=".jsonl", key=None)
@example(content=b"\xef\xbb\xbf", suffix=".json", key=None)
@example(content=b"\xff\xfe{\x00}\x00", suffix=".jsonl", key=None)  # UTF-16 with its BOM
@example(content=b"[" * 100_000, suffix=".json", key=None)
@example(content=b"[" * 100_000, suffix=".jsonl", key=None)
@example(content=b"1" * 5000 + b"\n", suffix=".jsonl", key=None)
@example(content=b'{"prompt": ' + b"9" * 5000 + b"}", suffix=".jsonl", key="prompt")
@example(content=b'{"prompt": "\\ud800"}', suffix=".jsonl", key="prompt")
@example(content=b'[{"prompt": "a\xed\xa0\x80"}]', suffix=".json", key="prompt")  # an encoded surrogate
@example(content=b'{"a": NaN, "b": -Infinity}\n\x1c\n', suffix=".jsonl", key=None)
def test_any_bytes_give_records_or_a_data_error_naming_the_place(content, suffix, key):
    read(write(content, suffix), key)


@FAST
@given(lines=st.lists(json_values | records, max_size=8), blank=st.lists(st.sampled_from(["", " ", "\r", "\t "])),
       ascii_only=st.booleans(), crlf=st.booleans())
def test_random_json_values_per_line_load_or_name_the_first_bad_line(lines, blank, ascii_only, crlf):
    texts = [json.dumps(v, ensure_ascii=ascii_only) for v in lines] + blank
    path = write(("\r\n" if crlf else "\n").join(texts).encode("utf-8"), ".jsonl")
    got = read(path)
    first_bad = next((i for i, v in enumerate(lines, start=1) if not isinstance(v, dict)), None)
    if first_bad is not None:
        assert isinstance(got, DataError) and line_of(got, path) == first_bad, got
    elif not any(isinstance(v, dict) for v in lines):
        assert isinstance(got, DataError) and "no records" in str(got)
    else:
        assert not isinstance(got, DataError), got
        assert json.dumps(got, sort_keys=True) == json.dumps(lines, sort_keys=True)  # NaN-safe comparison


@FAST
@given(doc=json_values | st.lists(records, max_size=6), key=st.sampled_from([None, "prompt"]))
def test_random_json_documents_load_or_name_the_record(doc, key):
    path = write(json.dumps(doc).encode("utf-8"), ".json")
    got = read(path, key)
    good = isinstance(doc, list) and doc and all(isinstance(r, dict) for r in doc)
    if good and (key is None or all(isinstance(r.get(key), str) for r in doc)):
        assert json.dumps(got, sort_keys=True) == json.dumps(doc, sort_keys=True)
    else:
        assert isinstance(got, DataError)


@FAST
@given(prompts=st.lists(st.text(max_size=40), min_size=1, max_size=6), bad_line=st.integers(0, 5),
       bad=st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80abc"]))
def test_invalid_utf8_names_its_line_and_keeps_the_line_out_of_the_message(prompts, bad_line, bad):
    lines = [json.dumps({"prompt": p}, ensure_ascii=False).encode("utf-8") for p in prompts]
    at = min(bad_line, len(lines) - 1)
    secret = b"SECRET" * 50
    lines[at] = lines[at][:-1] + secret + bad + b'"}'
    path = write(b"\n".join(lines), ".jsonl")
    got = read(path, "prompt")
    assert isinstance(got, DataError) and line_of(got, path) == at + 1
    assert "not UTF-8 text" in str(got) and "SECRET" not in str(got)


@FAST
@given(prompts=st.lists(st.text(max_size=20), min_size=1, max_size=5), suffix=st.sampled_from([".jsonl", ".json"]))
def test_a_utf8_bom_is_ignored_and_a_utf16_file_is_named(prompts, suffix):
    recs = [{"prompt": p} for p in prompts]
    text = json.dumps(recs) if suffix == ".json" else "\n".join(json.dumps(r) for r in recs)
    assert read(write(codecs.BOM_UTF8 + text.encode("utf-8"), suffix), "prompt") == recs
    utf16 = write(codecs.BOM_UTF16_LE + text.encode("utf-16-le"), suffix)
    got = read(utf16, "prompt")
    assert isinstance(got, DataError) and line_of(got, utf16) == 1


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_empty_and_blank_files_name_the_file(suffix):
    for content in (b"", b"\n\n", b" \r\n\t\n"):
        path = write(content, suffix)
        got = read(path)
        assert isinstance(got, DataError)
    assert "no records" in str(read(write(b"[]", ".json"))) and "no records" in str(read(write(b"\n", ".jsonl")))


def test_huge_lines_load_or_fail_without_being_printed():
    huge = "7" * 3_000_000
    path = write(b'{"prompt": "a"}\n' + json.dumps({"prompt": huge}).encode() + b"\n", ".jsonl")
    assert read(path, "prompt")[1]["prompt"] == huge
    broken = write(b'{"prompt": "a"}\n{"prompt": "' + huge.encode() + b"\n", ".jsonl")
    got = read(broken, "prompt")
    assert isinstance(got, DataError) and line_of(got, broken) == 2 and huge[:100] not in str(got)
    deep = write(b'{"prompt": "a", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n", ".jsonl")
    got = read(deep, "prompt")
    assert isinstance(got, DataError) and str(got) == f"{deep}:1: invalid JSON: nested too deeply"


def test_a_line_is_split_only_at_newlines():
    # JSON strings may hold U+2028, U+0085, \x1c raw: str.splitlines() would cut the record there
    text = json.dumps({"prompt": "a\u2028b\x85c\x1cd\x0be"}, ensure_ascii=False)
    assert read(write(text.encode("utf-8"), ".jsonl"), "prompt") == [{"prompt": "a\u2028b\x85c\x1cd\x0be"}]


def test_several_files_name_the_one_at_fault():
    good = write(b'{"prompt": "a"}\n', ".jsonl")
    bad = write(b'{"prompt": "a"}\n{"prompt": 1}\n', ".jsonl")
    with pytest.raises(DataError, match=re.escape(f"{bad}:2: field 'prompt' must be a string, it is a int")):
        load_records([str(good), str(bad)], "prompt")
