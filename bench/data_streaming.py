"""The driver's peak memory when a run reads its prompts from a large parquet file (issue 28, item 3).

For each size (default 100k and 1M records) it writes a parquet file of max-digit prompts, then, in a fresh
process, does what the driver and the producer's actor do with it: the preflight of the embedded default config
with ``runtime.data_path`` on the file (read into `datasets`' cache, cold, columns checked, prompt lengths
measured) and pickles the records as ``ray.put`` would: the driver's peak RSS (VmHWM, reset after the imports,
tokenizer and model files are loaded) above that baseline. Then, as the actor does, it unpickles them and reads
20 episodes of 128 rows: the peak RSS above the RSS before that. With ``--jsonl``, the same for a JSONL file of
the same rows (read into memory, as JSONL always is), for comparison. Prints a table, writes
bench/results/data_streaming.json.

    .venv/bin/python bench/data_streaming.py [--sizes 100000 1000000]
"""

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "data_streaming.json"


def write_data(directory: Path, rows: int, fmt: str = "parquet") -> Path:
    """``rows`` max-digit records (a prompt of about 50 characters, its answer), as parquet (row groups of 64k
    rows) or JSONL; written in slices, so writing a million costs no more memory than 64k."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = directory / f"prompts-{rows}.{fmt}"
    rng = random.Random(rows)
    step = 65_536
    writer = None
    with open(path, "w") if fmt == "jsonl" else open(os.devnull) as text:
        for start in range(0, rows, step):
            digits = [[rng.randrange(10) for _ in range(20)] for _ in range(min(step, rows - start))]
            prompts = ["max " + " ".join(map(str, d)) + " ?" for d in digits]
            answers = [str(max(d)) for d in digits]
            if fmt == "jsonl":
                pairs = zip(prompts, answers, strict=True)
                text.writelines(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in pairs)
                continue
            table = pa.table({"prompt": prompts, "answer": answers})
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
    if writer is not None:
        writer.close()
    return path


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM, RssAnon, RssFile)."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measure(path: str, tiny_dir: str, episodes: int = 20, per_episode: int = 128) -> dict:
    """In this (fresh) process: the preflight of the default config on ``path``, the records pickled and
    unpickled, ``episodes`` episodes of ``per_episode`` consecutive rows read. Peak RSS above the baseline."""
    from chatlearn.config import EngineChecks, load_config
    from chatlearn.data.preflight import preflight
    from chatlearn.models.hf.tiny import ensure_tiny_model
    from chatlearn.runtime.engines import resolve_engine

    os.environ["CHATLEARN_TINY_MODEL_DIR"] = tiny_dir
    ensure_tiny_model(tiny_dir)
    out = Path(tempfile.mkdtemp(prefix="data-streaming-out-"))

    def prepared(data_path: Path) -> tuple:
        cfg = load_config(os.path.join(REPO, "configs", "default.yaml"),
                          [f"runtime.data_path={data_path}", f"runtime.output_dir={out}"], [EngineChecks(None)])
        return cfg, resolve_engine(cfg, None, None)

    # once on a small file: the libraries, the tokenizer and the model files loaded are the baseline, not data
    preflight(*prepared(write_data(out, 100)))
    cfg, eng = prepared(Path(path))

    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS now (Linux >= 4.0)
        f.write("5")
    base = _status("VmRSS")
    t0 = time.perf_counter()
    data = preflight(cfg, eng)
    prepare_s = time.perf_counter() - t0
    after_prepare = _status("VmHWM")
    shipped = pickle.dumps(data.prompts)  # what ray.put sends the producer's actor
    driver_peak = _status("VmHWM")
    rows = len(data.prompts)
    del data
    with open("/proc/self/clear_refs", "w") as f:  # from here on: the actor's side
        f.write("5")
    actor_base = _status("VmRSS")
    records = pickle.loads(shipped)
    t0 = time.perf_counter()
    read = 0
    for e in range(episodes):
        start = (e * per_episode) % len(records)
        read += sum(len(records[(start + k) % len(records)]["prompt"]) > 0 for k in range(per_episode))
    read_s = time.perf_counter() - t0
    return {"rows": rows, "file_mb": round(os.path.getsize(path) / 2**20, 1),
            "baseline_rss_mb": round(base / 2**20, 1),
            "prepare_peak_increase_mb": round((after_prepare - base) / 2**20, 1),
            "driver_peak_increase_mb": round((driver_peak - base) / 2**20, 1),
            "actor_peak_increase_mb": round((_status("VmHWM") - actor_base) / 2**20, 1),
            "prepare_s": round(prepare_s, 2), "read_rows": read, "read_s": round(read_s, 3),
            "pickled_bytes": len(shipped)}


def measure_in_subprocess(path: Path, tiny_dir: str, cache: str, timeout: float = 600) -> dict:
    """`measure` in a fresh interpreter, with `datasets`' cache at ``cache`` (cold: the conversion counts)."""
    env = dict(os.environ, HF_DATASETS_CACHE=cache, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__, "--measure", str(path), "--tiny", tiny_dir], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--jsonl", action="store_true", help="also measure the same rows as JSONL (in memory)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.tiny)))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="data-streaming-") as tmp:
        tmp_path = Path(tmp)
        tiny = str(tmp_path / "tiny")
        for fmt in ["parquet", *(["jsonl"] if args.jsonl else [])]:
            for n in args.sizes:
                path = write_data(tmp_path, n, fmt)
                got = measure_in_subprocess(path, tiny, str(tmp_path / f"cache-{fmt}-{n}"))
                rows.append({"format": fmt, **got})
                path.unlink()
    print(f"{'format':8} {'records':>9} {'file MB':>8} {'prepare s':>9} {'driver peak +MB':>16} "
          f"{'shipped bytes':>13} {'actor peak +MB (reads)':>23}")
    for r in rows:
        print(f"{r['format']:8} {r['rows']:>9} {r['file_mb']:>8} {r['prepare_s']:>9} "
              f"{r['driver_peak_increase_mb']:>16} {r['pickled_bytes']:>13} {r['actor_peak_increase_mb']:>23}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"command": "bench/data_streaming.py " + " ".join(sys.argv[1:]),
                                   "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
