"""How cost grows: seconds per sample as `sample_per_episode` grows, and as the policy gets more replicas.

Each setting is one run of the real `chatlearn train` (the embedded default, with its own local Prefect
server, in a fresh output folder) with eval and checkpoints off (`runtime.eval_episode_interval=0
runtime.enable_eval_before_training=false runtime.save_episode_interval=null`) for `--episodes` episodes.
From the run's `metrics.jsonl`: medians over episodes 2..N (episode 1 includes Ray task-worker start-up and
the rule-reward workers' first imports) of seconds per episode and per stage, divided by the episode's
samples. `other` is the episode minus its stage bodies (the episode subflow's orchestration).

Two series:

    samples    sample_per_episode 128, 512, 2048 at the default layout: the six models colocated in one
               worker process with 2 CPUs (2 torch threads), the policy one replica in it.
               generation_batch_size stays 64 (and the train batches 32), so a bigger episode is more
               generation batches and more optimizer steps of the same size: the cost of more data, not of
               bigger batches.
    replicas   1, 2 and 4 policy replicas at sample_per_episode 512: the policy (the inference model that
               generates) taken out of the colocation group (`runtime.colocation=reference,reward,value,
               ppo_policy,ppo_value`) with `models.policy.num_cpu=N models.policy.cpu_per_process=1`, so N
               replicas = N worker processes of 1 CPU and 1 torch thread each; the other five models share
               one process of 2 CPUs as by default. ChatLearn's arithmetic (num_replica = num_cpu //
               cpu_per_process) cannot give 4 replicas of 2 threads on 2 cores without 8 threads, and
               cpu_per_process is an integer, so 1 thread a replica is the honest layout: 1 replica uses one
               core, 2 use both, 4 oversubscribe the 2 cores twice over. The local Ray gets as many logical
               CPUs as the plan asks for (`launch.init_ray`), so 4 such processes are placed on a 2-core
               machine. Generation batches (64 samples) are dealt round-robin over the replicas (8 batches
               at 512: 8, 4, 2 per replica), ppo_policy syncs to every replica across processes (a
               colocated policy gets an in-process copy), training and scoring are unchanged. The default
               layout at 512 (from the samples series) is shown beside them.

Every run's placement is checked: `placement.json` in the run folder must show the expected number of
policy replicas, each in its own worker process (distinct pids reported by the actors), apart from the
trainer's process in the replicas series and in it in the samples series; the run's printed placement
table is kept in the JSON. Ratios are to the smallest setting of each series (128 samples; 1 replica). The
machine is shared: the 1-minute load average and the number of other `chatlearn train` commands running
before each run are recorded. Prints a table and writes
`bench/results/scaling.json` and `bench/results/scaling.png` (two panels, ms per sample stacked by stage).
`--quick` runs a tiny version (sample_per_episode 32 and 64, 1 and 2 replicas at 64, batches of 16, 2
episodes) and writes its JSON and PNG to its temporary folder instead, to check the script works.

    .venv/bin/python bench/scaling.py [--episodes 5] [--quick] [key=value overrides]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_train_streamed  # noqa: E402  (bench/ is a folder of scripts, not a package)

STAGES = ("generate", "score", "train", "sync")
PARTS = (*STAGES, "other")
EXP = "scaling"
COMMON = ["runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false",
          "runtime.save_episode_interval=null", f"runtime.exp_name={EXP}"]
NOT_POLICY = "reference,reward,value,ppo_policy,ppo_value"


def replica_overrides(n: int) -> list[str]:
    """The policy alone, N processes of 1 CPU: N replicas; the other five models colocated as by default."""
    return [f"runtime.colocation={NOT_POLICY}", f"models.policy.num_cpu={n}", "models.policy.cpu_per_process=1"]


def placement_table(lines: list[tuple[float, str]]) -> list[str]:
    """The run's printed `placement (...)` table: its header line up to the first line after the rows."""
    texts = [text.rstrip() for _, text in lines]
    start = next((i for i, t in enumerate(texts) if t.startswith("placement (")), None)
    if start is None:
        return []
    table = [texts[start]]
    for t in texts[start + 1:]:
        if not (t.startswith("process") or t[:1].isdigit()):
            break
        table.append(t)
    return table


def check_placement(run_dir: Path, replicas: int, colocated: bool) -> dict[str, Any]:
    """What the run's placement.json says about the policy; exits if it is not the layout asked for."""
    placed = json.loads((run_dir / "placement.json").read_text())
    plan_reps = placed["plan"]["models"]["policy"]["num_replica"]
    pids = [rank["pid"] for rep in placed["ranks"]["policy"] for rank in rep]
    trainer = {rank["pid"] for rep in placed["ranks"]["ppo_policy"] for rank in rep}
    processes = {r["process"] for rep in placed["plan"]["models"]["policy"]["replicas"] for r in rep}
    ok = plan_reps == replicas and len(set(pids)) == replicas == len(pids) and len(processes) == replicas
    ok = ok and (bool(set(pids) & trainer) if colocated else not set(pids) & trainer)
    if not ok:
        raise SystemExit(f"placement in {run_dir}: policy has {plan_reps} replicas in pids {pids} (trainer "
                         f"{sorted(trainer)}); expected {replicas}, {'with' if colocated else 'apart from'} it")
    return {"policy_replicas": plan_reps, "policy_pids": pids, "trainer_pids": sorted(trainer),
            "worker_processes": len({rank["pid"] for reps in placed["ranks"].values() for rep in reps
                                     for rank in rep})}


def other_runs() -> int:
    """`chatlearn train` commands running on this machine now (another session's bench or test)."""
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        count += any(a.endswith(b"chatlearn") for a in args[:2]) and b"train" in args[1:3]
    return count


def batches_per_replica(samples: int, batch: int, replicas: int) -> list[int]:
    """Generation batches each policy replica gets in an episode (the generate task's own dealing)."""
    from chatlearn.data.sampler import episode_generation_batches
    dealt = Counter(r for r, _, _ in episode_generation_batches(10**6, 0, samples, batch, replicas))
    return [dealt[r] for r in range(replicas)]


def measure(series: str, setting: int, samples: int, replicas: int, overrides: list[str], episodes: int,
            batch: int, root: Path) -> dict[str, Any]:
    """One `chatlearn train` run of one setting; its medians over episodes 2..N."""
    out = root / f"{series}-{setting}"
    load, others = os.getloadavg()[0], other_runs()
    args = [*COMMON, f"runtime.num_episode={episodes}", f"runtime.sample_per_episode={samples}", *overrides]
    print(f"[{series} {setting}] chatlearn train {' '.join(args)}", flush=True)
    wall, lines = run_train_streamed(out, args, what=f"{series} {setting}")
    rows = [json.loads(line) for line in (out / EXP / "metrics.jsonl").read_text().splitlines()]
    assert all(r["num_samples"] == samples for r in rows), [r["num_samples"] for r in rows]
    steady = rows[1:] or rows
    per_episode = {k: [r["stage_seconds"].get(k, 0.0) for r in steady] for k in STAGES}
    per_episode["other"] = [r["episode_seconds"] - sum(r["stage_seconds"].values()) for r in steady]
    episode = statistics.median(r["episode_seconds"] for r in steady)
    stage = {k: statistics.median(v) for k, v in per_episode.items()}
    placement = check_placement(out / EXP, replicas, colocated=series == "samples")
    result = {
        "series": series, "setting": setting, "sample_per_episode": samples, "policy_replicas": replicas,
        "episodes": len(rows), "steady_episodes": len(steady), "episode_seconds": episode,
        "seconds_per_sample": episode / samples,
        "stage_seconds": stage, "stage_seconds_per_sample": {k: v / samples for k, v in stage.items()},
        "episode_seconds_all": [r["episode_seconds"] for r in rows],
        "first_episode_seconds": rows[0]["episode_seconds"], "startup_seconds": rows[0].get("startup_seconds"),
        "wall_seconds": wall, "load_average_before": load,
        "other_chatlearn_runs_before": others, "peak_memory_mb": max(r["peak_memory_mb"] for r in rows),
        "generation_batches_per_replica": batches_per_replica(samples, batch, replicas),
        "placement": placement, "placement_table": placement_table(lines), "overrides": args,
    }
    print(f"  {episode:.2f} s/episode, {1000 * episode / samples:.2f} ms/sample, policy pids "
          f"{placement['policy_pids']}, wall {wall:.0f}s", flush=True)
    return result


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each setting's seconds per sample and per episode over its series' smallest setting's."""
    for series in ("samples", "replicas"):
        rows = [r for r in results if r["series"] == series]
        base = min(rows, key=lambda r: r["setting"])
        for r in rows:
            r["ratio_seconds_per_sample"] = r["seconds_per_sample"] / base["seconds_per_sample"]
            r["ratio_episode_seconds"] = r["episode_seconds"] / base["episode_seconds"]


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'series':9s} {'setting':>7s} {'samples':>7s} {'s/episode':>9s} {'ms/sample':>9s} "
            + " ".join(f"{k:>8s}" for k in PARTS) + f" {'x s/smp':>7s} {'x s/ep':>7s} {'ready s':>7s} {'load':>5s}")
    lines = [head, "(stage columns: ms per sample; x: ratio to the series' smallest setting; ready: start-up "
                   "seconds; load: 1-minute load average before the run)"]
    for r in results:
        per = r["stage_seconds_per_sample"]
        lines.append(f"{r['series']:9s} {r['setting']:>7d} {r['sample_per_episode']:>7d} "
                     f"{r['episode_seconds']:>9.2f} {1000 * r['seconds_per_sample']:>9.2f} "
                     + " ".join(f"{1000 * per[k]:>8.2f}" for k in PARTS)
                     + f" {r['ratio_seconds_per_sample']:>7.2f} {r['ratio_episode_seconds']:>7.2f}"
                     + f" {r['startup_seconds'] or float('nan'):>7.1f} {r['load_average_before']:>5.1f}")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], reference: dict[str, Any] | None, dest: Path) -> None:
    """Two panels of bars, ms per sample stacked by stage: against sample_per_episode, against replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"generate": "tab:blue", "score": "tab:orange", "train": "tab:green", "sync": "tab:red",
              "other": "tab:gray"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [("samples", "sample_per_episode (default layout, 1 policy replica)", None),
              ("replicas", "policy replicas (1 CPU / 1 thread each), sample_per_episode "
               f"{reference['sample_per_episode'] if reference else ''}", reference)]
    for ax, (series, xlabel, ref) in zip(axes, panels, strict=True):
        rows = sorted((r for r in results if r["series"] == series), key=lambda r: r["setting"])
        bars = ([("default\n(colocated)", ref, "//")] if ref else []) + [(str(r["setting"]), r, "") for r in rows]
        x = range(len(bars))
        bottom = [0.0] * len(bars)
        for part in PARTS:
            heights = [1000 * row["stage_seconds_per_sample"][part] for _, row, _ in bars]
            ax.bar(x, heights, bottom=bottom, color=colors[part], label=part,
                   hatch=[h for _, _, h in bars], edgecolor="white")
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for i, (_, row, _) in enumerate(bars):  # the median episode's ms per sample (stage medians don't add up)
            ax.text(i, max(bottom[i], 1000 * row["seconds_per_sample"]), f"{1000 * row['seconds_per_sample']:.1f}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.3 * max(max(bottom), *(1000 * row["seconds_per_sample"] for _, row, _ in bars)))
        ax.set_xticks(list(x), [label for label, _, _ in bars])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per sample (stage medians; label: episode)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title("cost per sample vs episode size")
    axes[1].set_title("cost per sample vs policy replicas (2 CPU cores)")
    axes[0].legend(fontsize=8, ncol=5, loc="upper center")
    fig.tight_layout()
    fig.savefig(dest, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=None,
                        help="episodes per run; medians over 2..N (default 5; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a tiny version, to check the script works")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.quick:
        samples, replicas, replica_samples, batch, train_batch = (32, 64), (1, 2), 64, 16, 16
    else:
        samples, replicas, replica_samples, batch, train_batch = (128, 512, 2048), (1, 2, 4), 512, 64, 32
    episodes = args.episodes or (2 if args.quick else 5)
    batches = [f"runtime.generation_batch_size={batch}", f"runtime.train_micro_batch_size={train_batch}",
               f"runtime.train_global_batch_size={train_batch}"]
    root = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    t0 = time.perf_counter()
    results = []
    for n in samples:
        results.append(measure("samples", n, n, 1, [*batches, *args.overrides], episodes, batch, root))
    for n in replicas:
        results.append(measure("replicas", n, replica_samples, n, [*batches, *replica_overrides(n),
                                                                   *args.overrides], episodes, batch, root))
    total = time.perf_counter() - t0
    add_ratios(results)
    reference = next((r for r in results if r["series"] == "samples" and r["setting"] == replica_samples), None)
    print(table(results))
    print(f"total {total:.0f}s; runs in {root}")
    result = {
        "machine": f"{os.cpu_count()} CPUs", "quick": args.quick, "episodes_per_run": episodes,
        "generation_batch_size": batch, "train_batch_size": train_batch,
        "replica_sample_per_episode": replica_samples,
        "replica_layout": [f"runtime.colocation={NOT_POLICY}", "models.policy.num_cpu=N",
                           "models.policy.cpu_per_process=1"],
        "total_wall_seconds": total, "results": results,
    }
    dest = root if args.quick else REPO / "bench" / "results"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "scaling.json").write_text(json.dumps(result, indent=1))
    plot(results, reference, dest / "scaling.png")
    print(f"wrote {dest / 'scaling.json'} and {dest / 'scaling.png'}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
