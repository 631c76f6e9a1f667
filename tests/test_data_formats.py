"""Data files in every format (`chatlearn.data.records`): JSONL, JSON, parquet, Arrow, CSV and a `save_to_disk`
directory give the same prepared prompts; chat-message prompts are rendered with the model's chat template and
measured as rendered; a bad file is one DataError naming the file and the row; a large table is read lazily and
ships to the actors as its file paths, so the driver's peak memory does not grow with the file."""

import json
import os
import pickle
import shutil
import sys

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from chatlearn.data.prompts import DataError
from chatlearn.data.records import Records, read_records
from tests.conftest import REPO
from tests.test_preflight import CONTEXT, checked

ROWS = [{"prompt": f"max {a} {b} ?", "answer": f"a{max(a, b)}"} for a, b in [(1, 2), (7, 3), (4, 4), (0, 9)]]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture
def tiny(tiny_model_dir, monkeypatch):
    """The default configs' models all on the session's tiny Llama (already built)."""
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    return tiny_model_dir


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """`datasets`' cache in the test's folder (the conversion's child process reads the variable)."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def write(fmt: str, rows: list[dict], directory) -> str:
    """``rows`` as a file (or directory) of format ``fmt``."""
    path = directory / f"data.{fmt}" if fmt != "disk" else directory / "saved"
    table = pa.Table.from_pylist(rows)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "arrow":  # the IPC file format (Feather v2), not only the stream `datasets` writes itself
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table)
    elif fmt == "csv":
        pcsv.write_csv(table, path)
    elif fmt == "disk":
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def chat_model(tiny_dir: str, directory) -> str:
    """The tiny Llama with a chat template in its tokenizer files."""
    from transformers import AutoTokenizer

    path = directory / "chat-model"
    shutil.copytree(tiny_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def chat(rows: list[dict]) -> list[dict]:
    return [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]


@pytest.mark.parametrize("fmt", ["json", "parquet", "arrow", "csv", "disk"])
def test_every_format_gives_the_same_prepared_prompts(fmt, tiny, tmp_path):
    expected = checked(tmp_path, f"runtime.data_path={write('jsonl', ROWS, tmp_path)}").prompts
    got = checked(tmp_path, f"runtime.data_path={write(fmt, ROWS, tmp_path)}").prompts
    assert isinstance(got, Records) and len(got) == len(ROWS)
    assert [dict(r) for r in got] == [dict(r) for r in expected] == ROWS
    if fmt not in ("json", "jsonl"):
        assert got.place(3).endswith(": row 3")


def test_a_list_of_paths_of_mixed_formats_reads_in_order(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    got = read_records([write("parquet", ROWS[:2], tmp_path / "a"), write("jsonl", ROWS[2:], tmp_path / "b")],
                       ["prompt"])
    assert list(got) == ROWS and got.place(2).endswith("data.jsonl:1") and got[-1] == ROWS[-1]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow", "disk"])
def test_chat_prompts_are_rendered_with_the_chat_template(fmt, tiny, tmp_path):
    model = chat_model(tiny, tmp_path)
    data = write(fmt, chat(ROWS), tmp_path)
    out = checked(tmp_path, f"runtime.data_path={data}", f"models.policy.args_dict.model_path={model}")
    assert [r["prompt"] for r in out.prompts] == [f"user: {r['prompt']} assistant:" for r in ROWS]
    assert [r["answer"] for r in out.prompts] == [r["answer"] for r in ROWS]
    # what the actor gets renders the same
    assert list(pickle.loads(pickle.dumps(out.prompts))) == list(out.prompts)


def test_the_length_check_measures_the_rendered_prompt(tiny, tmp_path):
    model = chat_model(tiny, tmp_path)
    # 50 characters: 51 tokens as text (fits 64 - 2 new tokens), 68 rendered ("user: " ... " assistant:")
    long = "max " + "1 " * 22 + "9 ?"
    rows = [*ROWS[:1], {"prompt": long, "answer": "a9"}]
    data = write("parquet", chat(rows), tmp_path)
    with pytest.raises(DataError) as err:
        checked(tmp_path, f"runtime.data_path={data}", f"models.policy.args_dict.model_path={model}")
    assert str(err.value).startswith(f"{data}: row 1: prompt of {len(long) + 18} tokens is longer than the 62 "
                                     "that fit")
    out = checked(tmp_path, f"runtime.data_path={data}", f"models.policy.args_dict.model_path={model}",
                  "models.policy.args_dict.truncate_long_prompts=true")
    rendered = f"user: {long} assistant:"
    assert out.prompts[1]["prompt"] == rendered[-(CONTEXT - 2 - 1):]  # its end kept: the generation prompt
    assert out.prompts[0]["prompt"] == f"user: {ROWS[0]['prompt']} assistant:"


def test_chat_prompts_without_a_chat_template_name_the_row_and_the_model(tiny, tmp_path):
    data = write("parquet", chat(ROWS), tmp_path)
    with pytest.raises(DataError) as err:
        checked(tmp_path, f"runtime.data_path={data}")
    assert str(err.value).startswith(f"{data}: row 0: the prompt is a list of chat messages, and the tokenizer of "
                                     f"{tiny} (models.policy.args_dict.model_path) has no chat template")


def test_bad_tables_are_one_error_naming_the_file_and_the_row(tmp_path):
    def error(path, keys=("prompt",), chat_key="prompt"):
        with pytest.raises(DataError) as err:
            read_records(str(path), list(keys), chat_key)
        return str(err.value)

    assert error(tmp_path / "none.parquet") == f"{tmp_path / 'none.parquet'}: data file not found"
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    assert error(bad).startswith(f"{bad}: cannot read it as parquet: ArrowInvalid: ")
    (tmp_path / "q").mkdir()
    other = write("parquet", [{"question": "q", "answer": "a"}], tmp_path / "q")
    assert error(other) == f"{other}: no column 'prompt' (its columns: question, answer)"
    (tmp_path / "n").mkdir()
    numbers = write("parquet", [{"prompt": 3}], tmp_path / "n")
    assert error(numbers) == (f"{numbers}: row 0: field 'prompt' must be a string or a list of chat messages, it is "
                              "a int64 (the column's type)")
    (tmp_path / "m").mkdir()
    missing = write("parquet", [*ROWS * 5, {"prompt": None, "answer": "x"}], tmp_path / "m")
    assert error(missing) == f"{missing}: row 20: field 'prompt' must be a string, it is missing"
    (tmp_path / "c").mkdir()
    messages = [[{"role": "user", "content": "hi"}]] * 3 + [[{"role": "system", "content": "s"}, {"role": "user"}]]
    broken = write("parquet", [{"prompt": m} for m in messages], tmp_path / "c")
    assert error(broken) == (f"{broken}: row 3: field 'prompt' must be a list of chat messages, it is a list whose "
                             "message 1 has no 'content'")
    assert error(broken, chat_key=None).startswith(f"{broken}: row 0: field 'prompt' must be a string, it is a list")
    (tmp_path / "d").mkdir()
    pairs = write("csv", [{"prompt": "p", "chosen": "c"}], tmp_path / "d")
    assert error(pairs, ("prompt", "chosen", "rejected")) == (f"{pairs}: no column 'rejected' (its columns: prompt, "
                                                              "chosen)")
    (tmp_path / "e").mkdir()
    empty = write("parquet", [{"prompt": "x"}], tmp_path / "e")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    assert error(empty) == f"{empty}: no records (empty, or blank lines only)"


def test_a_jsonl_chat_prompt_is_checked_at_its_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"prompt": "max 1 ?"}) + "\n" + json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError) as err:
        read_records(str(bad), ["prompt"], "prompt")
    assert str(err.value) == (f"{bad}:2: field 'prompt' must be a string or a list of chat messages, it is a list "
                              "whose message 0 has 'content' missing, not a string")
    with pytest.raises(DataError, match=r"p\.jsonl:2: field 'prompt' must be a string, it is a list"):
        read_records(str(bad), ["prompt"])  # where chat prompts are not taken (load_records)


def test_a_large_table_ships_as_its_paths_and_a_small_one_with_its_rows(tmp_path, monkeypatch):
    from chatlearn.data import records as records_module

    data = write("parquet", ROWS * 100, tmp_path)
    got = read_records(data, ["prompt"])
    small = pickle.dumps(got)
    assert len(small) > 400 * 10  # the rows travel with it
    monkeypatch.setattr(records_module, "SHIP_BY_VALUE_BYTES", 0)
    by_reference = pickle.dumps(got)
    assert len(by_reference) < 4096  # the memory-mapped cache file's path, not its rows
    for blob in (small, by_reference):
        back = pickle.loads(blob)
        assert len(back) == 400 and back[399] == ROWS[-1] and back.place(5) == f"{data}: row 5"


def test_ranking_reorders_records_without_reading_them_into_a_list(tmp_path):
    from chatlearn.data.ranking import rank_prompts

    rows = [{"prompt": "1 " * n} for n in (1, 3, 2, 5)]
    got = rank_prompts(read_records(write("parquet", rows, tmp_path), ["prompt"]), 2)
    assert isinstance(got, Records)
    assert [r["prompt"] for r in got] == ["1 " * n for n in (3, 1, 5, 2)] and got.place(0).endswith(": row 1")


def answer_hook(sample: dict, answer_key: str = "answer") -> float:
    return float(sample["response"] == sample[answer_key])


def no_answer_key(sample: dict) -> float:
    return 0.0


def test_a_rule_reward_reads_the_reference_answer_from_answer_key():
    from chatlearn.models.hf.reward import RuleRewardArgs
    from chatlearn.models.rule import RuleSpec
    from chatlearn.tasks.math_verify import math_reward

    args = RuleRewardArgs(reward_fn="tests.test_data_formats:answer_hook", answer_key="solution")
    batch = {"response": ["7", "3"], "solution": ["7", "4"], "answer": ["0", "3"], "sample_id": [0, 1]}
    assert RuleSpec.of(args).score(batch) == [1.0, 0.0]
    assert RuleSpec.of(args.model_copy(update={"answer_key": None})).score(batch) == [0.0, 1.0]
    with pytest.raises(ValueError, match="takes no answer_key argument"):
        RuleRewardArgs(reward_fn="tests.test_data_formats:no_answer_key", answer_key="solution")
    assert math_reward({"response": "so \\boxed{4}", "solution": "#### 4"}, answer_key="solution") == 1.0


@pytest.mark.slow
def test_the_drivers_peak_memory_does_not_grow_with_the_parquet_file(tmp_path):
    """The preflight and the pickling of 20k and 400k records (bench/data_streaming.py measures 100k and 1M):
    the driver's peak RSS above its baseline is about the same; the records are shipped as paths at 400k."""
    sys.path.insert(0, REPO)
    from bench.data_streaming import measure_in_subprocess, write_data

    got = []
    for rows in (20_000, 400_000):
        path = write_data(tmp_path, rows)
        got.append(measure_in_subprocess(path, os.environ.get("CHATLEARN_TINY_MODEL_DIR", str(tmp_path / "tiny")),
                                         str(tmp_path / f"cache-{rows}")))
    small, large = got
    assert large["rows"] == 400_000 and large["file_mb"] > 10 * small["file_mb"]
    assert large["pickled_bytes"] < 4096
    assert large["driver_peak_increase_mb"] < small["driver_peak_increase_mb"] + 15, got
    assert large["actor_peak_increase_mb"] < 15, got


@pytest.mark.integration
def test_a_grpo_run_on_a_parquet_file_of_chat_prompts(prefect_api, ray_session, tiny_model_dir, tmp_path):
    from flows import train_flow
    from tests.test_engine_runs import rows_of, small

    model = chat_model(tiny_model_dir, tmp_path)
    rows = [{"prompt": [{"role": "user", "content": f"max {a} {b} ?"}], "answer": str(max(a, b))}
            for a in range(10) for b in range(4)]
    data = write("parquet", rows, tmp_path)
    cfg = small("grpo", tmp_path, tiny_model_dir, "runtime.num_episode=1", "runtime.eval_episode_interval=0",
                "runtime.enable_eval_before_training=false", f"runtime.data_path={data}",
                f"models.policy.args_dict.model_path={model}", "runtime.exp_name=parquet-chat")
    train_flow(cfg)
    (row,) = rows_of(tmp_path / "parquet-chat")
    assert row["episode"] == 1 and row["num_samples"] == 32 and row["train_steps"] >= 1
