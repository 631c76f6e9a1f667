"""Does an episode's orchestration cost grow as Prefect's database fills? And how far is start-up above the
floor of importing torch and transformers?

One long run of the real `chatlearn train` of the cheapest config (the embedded default at tiny sizes: 8
samples an episode, batches of 8, no eval, no checkpoints, 2 new tokens), with its own local Prefect server
on a fresh database that gains one episode subflow, its tasks, logs and events per episode. From the run's
`metrics.jsonl` and the moments its `[episode N/M]` lines appeared, medians over episodes 5-15 against the
last eleven (290-300 of 300):

    episode_seconds             the episode subflow call (what the train flow times)
    overhead                    episode_seconds minus the sum of its stage bodies' seconds
    cadence                     one `[episode N/M]` line to the next: the whole loop iteration
    between                     cadence minus episode_seconds: the train flow's own per-episode work
                                (metrics file, progress/table/curve artifacts, curves.png)

plus a least-squares slope of overhead and of cadence over all episodes after the 5th, in seconds per 100
episodes. Start-up: seconds from the command to its `ready to train` line (the first episode starts then)
and to the first episode's line, next to `python -c "import torch, transformers"` in a fresh interpreter
(median of a few). Prints a table and writes `bench/results/episode_growth.json`.

    .venv/bin/python bench/episode_growth.py [--episodes 300] [--import-rounds 5] [key=value overrides]
"""

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, first_line_at, import_floor, run_train_streamed  # noqa: E402  (bench/: scripts)

CHEAPEST = ["runtime.sample_per_episode=8", "runtime.generation_batch_size=8", "runtime.train_micro_batch_size=8",
            "runtime.train_global_batch_size=8", "runtime.eval_episode_interval=0",
            "runtime.enable_eval_before_training=false", "runtime.save_episode_interval=0",
            "models.policy.args_dict.max_new_tokens=2", "runtime.log_interval=1", "runtime.exp_name=growth"]
EPISODE_LINE = re.compile(r"\[episode (\d+)/\d+\]")


def slope_per_100(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs, times 100."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def window(rows: list[dict], first: int, last: int) -> dict:
    """Medians over the rows of episodes first..last (1-based, inclusive)."""
    sel = [r for r in rows if first <= r["n"] <= last]
    keys = ("episode_seconds", "stage_seconds_sum", "overhead", "cadence", "between")
    out = {k: statistics.median(r[k] for r in sel if r.get(k) is not None) if any(r.get(k) is not None for r in sel)
           else None for k in keys}
    out["episodes"] = f"{first}-{last}"
    out["count"] = len(sel)
    return out


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=300, help="episodes of the long run (default 300)")
    parser.add_argument("--import-rounds", type=int, default=5, help="timed `import torch, transformers` runs")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides on top of the cheapest config")
    args = parser.parse_args(argv)
    n = args.episodes
    if n < 20:
        raise SystemExit("--episodes: at least 20 (the windows are episodes 5-15 and the last eleven)")

    floor = import_floor(args.import_rounds)
    print(f"import torch, transformers: {floor['median']:.2f}s (median of {floor['rounds']})", file=sys.stderr)
    out = Path(tempfile.mkdtemp(prefix="bench-growth-"))
    overrides = [*CHEAPEST, f"runtime.num_episode={n}", *args.overrides]
    wall, lines = run_train_streamed(out, overrides, "the long run")
    metrics = [json.loads(line) for line in (out / "growth" / "metrics.jsonl").read_text().splitlines()]

    seen: dict[int, float] = {}
    for t, text in lines:
        for m in EPISODE_LINE.finditer(text):
            seen.setdefault(int(m.group(1)), t)
    rows = []
    for r in metrics:
        k = r["episode"]
        stages = sum(r["stage_seconds"].values())
        row = {"n": k, "episode_seconds": r["episode_seconds"], "stage_seconds_sum": stages,
               "overhead": r["episode_seconds"] - stages}
        if k in seen and k - 1 in seen:
            row["cadence"] = seen[k] - seen[k - 1]
            row["between"] = row["cadence"] - r["episode_seconds"]
        rows.append(row)

    early, late = window(rows, 5, 15), window(rows, n - 10, n)
    later = [r for r in rows if r["n"] > 5]
    db = out / "prefect" / "prefect.db"
    result = {
        "episodes": n, "overrides": overrides, "machine": f"{os.cpu_count()} CPUs", "wall_seconds": wall,
        "import_floor": floor,
        "startup": {"command_to_server_seconds": first_line_at(lines, "Prefect UI ("),
                    "command_to_ready_seconds": first_line_at(lines, "ready to train"),
                    "command_to_first_episode_line_seconds": seen.get(1),
                    "startup_seconds_in_flow": metrics[0].get("startup_seconds"),
                    "first_episode_seconds": metrics[0]["episode_seconds"]},
        "early": early, "late": late,
        "slope_per_100_episodes": {
            "overhead": slope_per_100([r["n"] for r in later], [r["overhead"] for r in later]),
            "episode_seconds": slope_per_100([r["n"] for r in later], [r["episode_seconds"] for r in later]),
            "cadence": slope_per_100([r["n"] for r in later if "cadence" in r],
                                     [r["cadence"] for r in later if "cadence" in r]),
        },
        "prefect_db_bytes": db.stat().st_size if db.exists() else None,
        "rows": rows,
    }

    s = result["startup"]
    print(f"\nstart-up ({n}-episode run of the cheapest config)")
    print(f"  import torch, transformers (fresh interpreter, median of {floor['rounds']})  {floor['median']:6.2f}s "
          f"(min {floor['min']:.2f}, max {floor['max']:.2f})")
    for key, label in (("command_to_server_seconds", "command -> Prefect server up"),
                       ("command_to_ready_seconds", "command -> 'ready to train' (1st episode starts)"),
                       ("command_to_first_episode_line_seconds", "command -> 1st episode's line"),
                       ("startup_seconds_in_flow", "train flow's own startup_seconds"),
                       ("first_episode_seconds", "1st episode_seconds")):
        v = s[key]
        print(f"  {label:58s} {v:6.2f}s" if v is not None else f"  {label:58s}      -")
    if s["command_to_ready_seconds"]:
        print(f"  command -> ready is {s['command_to_ready_seconds'] / floor['median']:.1f}x the import floor")
    print(f"\nper episode, medians (seconds)   {'episodes':>9s} {'episode':>8s} {'stages':>7s} {'overhead':>8s} "
          f"{'cadence':>8s} {'between':>8s}")
    for label, w in (("early", early), ("late", late)):
        cells = " ".join(f"{w[k]:8.3f}" if w[k] is not None else "       -"
                         for k in ("episode_seconds", "stage_seconds_sum", "overhead", "cadence", "between"))
        print(f"{label:32s} {w['episodes']:>9s} {cells}")
    sl = result["slope_per_100_episodes"]
    print("slope per 100 episodes (all after the 5th): " + ", ".join(
        f"{k} {v:+.3f}s" for k, v in sl.items() if v is not None))
    if result["prefect_db_bytes"]:
        print(f"Prefect database after the run: {result['prefect_db_bytes'] / 2**20:.1f} MiB")
    path = REPO / "bench" / "results" / "episode_growth.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path.relative_to(REPO)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
