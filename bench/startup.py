"""Start-up to the first episode: the embedded default colocated (one worker process for six models) against
one process of one core per model (the layout before colocation), and ``concurrent_setup`` on and off there,
measured side by side in one run.

Each variant runs the real `chatlearn train` for one episode (no eval); rounds interleave the variants so
machine noise hits them alike. ``startup_seconds`` is the train flow's own measure (config → Ray → workers →
model setup → first sync); ``to ready`` is from the command to its ``ready to train`` line (the first
episode starts then: interpreter, imports, Prefect server, config, Ray, workers, model setup, first sync),
shown next to the floor under it: ``python -c "import torch, transformers"`` in a fresh interpreter (median
of a few runs, timed between the rounds); ``wall`` adds the episode, Prefect server stop and shutdown.
Medians over the rounds. Prints a table and writes ``bench/results/startup.json``.

    .venv/bin/python bench/startup.py [rounds]
"""

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, first_line_at, import_floor, run_train_streamed  # noqa: E402  (bench/: scripts)

ONE_EPISODE = ["runtime.num_episode=1", "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false"]
# the layout before colocation: six processes of one core each
SEPARATE = ["runtime.colocation=[]", *[f"models.{m}.{k}=1" for m in ("policy", "reference", "reward", "value",
                                                                  "ppo_policy", "ppo_value")
                                       for k in ("num_cpu", "cpu_per_process")]]
VARIANTS = {
    "colocated (default)": [],
    "one process per model, concurrent setup": SEPARATE,
    "one process per model, setup one by one": [*SEPARATE, "runtime.concurrent_setup=false"],
}


def run(name: str, overrides: list[str], out: Path) -> dict:
    exp = name.split()[0].replace(",", "")
    wall, lines = run_train_streamed(out, [f"runtime.exp_name={exp}", *ONE_EPISODE, *overrides], name)
    row = json.loads((out / exp / "metrics.jsonl").read_text().splitlines()[0])
    placement = json.loads((out / exp / "placement.json").read_text())
    setups = [r["setup_seconds"] for reps in placement["ranks"].values() for rep in reps for r in rep]
    return {"startup_seconds": row["startup_seconds"], "wall_seconds": wall,
            "command_to_ready_seconds": first_line_at(lines, "ready to train"),
            "command_to_server_seconds": first_line_at(lines, "Prefect UI ("),
            "first_episode_seconds": row["episode_seconds"], "reward_mean": row["reward_mean"],
            "processes": len({r["pid"] for reps in placement["ranks"].values() for rep in reps for r in rep}),
            "model_setup_seconds_sum": sum(setups)}


def main(rounds: int) -> dict:
    samples: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    floors = []
    for i in range(rounds):
        floors.append(import_floor(3)["median"])  # between the rounds: the same machine load as the runs
        for name, overrides in VARIANTS.items():
            out = Path(tempfile.mkdtemp(prefix="bench-startup-"))
            samples[name].append(run(name, overrides, out))
            print(f"round {i + 1}: {name}: {samples[name][-1]['startup_seconds']:.1f}s", file=sys.stderr)
    result = {}
    for name, runs in samples.items():
        result[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        result[name]["rounds"] = len(runs)
    floor = statistics.median(floors)
    base = result["one process per model, concurrent setup"]["startup_seconds"]
    print(f"{'variant':44s} {'processes':>9s} {'startup s':>9s} {'vs 6 procs':>10s} {'to ready s':>10s} "
          f"{'/ floor':>7s} {'wall s':>7s} {'1st episode s':>13s} {'reward':>7s}")
    for name, r in result.items():
        print(f"{name:44s} {r['processes']:9.0f} {r['startup_seconds']:9.1f} {r['startup_seconds'] / base:10.2f} "
              f"{r['command_to_ready_seconds']:10.1f} {r['command_to_ready_seconds'] / floor:7.1f} "
              f"{r['wall_seconds']:7.1f} {r['first_episode_seconds']:13.1f} {r['reward_mean']:7.4f}")
    label = 'floor: python -c "import torch, transformers"'
    print(f"{label:44s} {'':9s} {'':9s} {'':10s} {floor:10.1f} {1.0:7.1f}")
    path = REPO / "bench" / "results" / "startup.json"
    path.write_text(json.dumps({"rounds": rounds, "variants": result,
                                "import_floor_seconds": {"median": floor, "per_round": floors,
                                                         "what": 'python -c "import torch, transformers"'},
                                "machine": f"{os.cpu_count()} CPUs"}, indent=1))
    print(f"wrote {path.relative_to(REPO)}")
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
