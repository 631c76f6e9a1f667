"""Memory soak: does each process's resident memory stay flat over a long run of a feature-heavy config?

The real `chatlearn train` on configs/rloo.yaml turned into what a new user tries first: the tied GQA Qwen2
(`tiny_qwen2.yaml`) for every model, bf16, `runtime.rollout_engine=continuous`, packing on the reference and the
trainer, LoRA on the trainer, the RLOO estimator with the CISPO policy loss and a checkpoint every episode; small
episodes (2 prompts x 8 responses, two packed micro-batches, no eval) so that a few hundred of them run in well
under an hour on a busy 2-core machine.

While it runs, a sampler polls (every 0.25 s) `run_dir/metrics.jsonl`; when an episode's row appears (the episode
is over, the next has grown nothing yet) it reads the resident memory (RSS, psutil) and CPU seconds of every
process: the driver (the `chatlearn train` process), each model process `run_dir/placement.json` names, the
Prefect server, Ray's services (GCS, dashboard and its agents, monitors, the reaper) and the raylet with Ray's
other workers (the rule reward's tasks, the data stream actor), the last two summed per kind; the JSON also keeps
each process apart. It keeps the row's `peak_memory_mb` too: the largest model process's high-water mark
(`ru_maxrss`), which only ever goes up.

Reported per line: RSS at episode 1, at the end of warm-up (`--warmup`), at the last episode, its maximum, the
least-squares slope after warm-up in MB per episode and the CPU seconds an episode took after warm-up. Prints a
table, writes `bench/results/memory_soak.json` and the plot of RSS per episode `bench/results/memory_soak.png`
(`--tag T`: `memory_soak-T.*`, for a comparison run). `--unbounded` runs with oneDNN's default kernel caches
(1,024 entries each, as before `chatlearn.models.precision` bounded them), to show the growth the bound
removes; `--override K=V` adds or replaces a config override (e.g. to turn one feature off).

    .venv/bin/python bench/memory_soak.py [--episodes 300] [--warmup 20] [--unbounded] [--tag T] [--override ...]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO  # noqa: E402  (bench/ is a folder of scripts, not a package)

from chatlearn.models.precision import CACHE_VARIABLES  # noqa: E402

MODELS = ("policy", "reference", "ppo_policy")
CONFIG = "configs/rloo.yaml"  # RLOO estimator, grpo engine; the overrides below make it the config
EXP = "memory_soak"
OVERRIDES = [
    *[f"models.{m}.model_config_file=tiny_qwen2.yaml" for m in MODELS],
    *[f"models.{m}.args_dict.bf16=true" for m in MODELS],
    "runtime.rollout_engine=continuous",
    "models.reference.packing=true", "models.ppo_policy.packing=true",
    "models.ppo_policy.lora.enable_lora=true",
    "models.ppo_policy.args_dict.policy_loss=cispo",
    "runtime.save_episode_interval=1",
    # small episodes: 2 prompts x 8 responses, one train step over two micro-batches; no eval
    "runtime.sample_per_episode=16", "runtime.generation_batch_size=16", "runtime.train_micro_batch_size=8",
    "runtime.train_global_batch_size=16", "runtime.eval_episode_interval=0",
    "runtime.enable_eval_before_training=false", f"runtime.exp_name={EXP}",
]
POLL_S = 0.25
PEAK = "peak_memory_mb (metrics row)"
WORKERS = "raylet and Ray workers (rule reward tasks, data stream)"


def _merge(base: list[str], extra: list[str]) -> list[str]:
    """`base` with each `key=value` of `extra` replacing the same key (or appended)."""
    out = {o.split("=", 1)[0]: o for o in base}
    for o in extra:
        out[o.split("=", 1)[0]] = o
    return list(out.values())


def _rss_mb(proc: psutil.Process) -> float | None:
    try:
        return proc.memory_info().rss / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class Sampler:
    """Per episode, each process's RSS when the episode's metrics row appears."""

    def __init__(self, driver: psutil.Process, run_dir: Path) -> None:
        self.driver, self.run_dir = driver, run_dir
        self.rows: list[dict] = []  # one per episode: {"episode", "rss_mb": {process: MB}, "peak_memory_mb"}
        self.stop = threading.Event()
        self.models: dict[int, str] = {}  # pid -> "model process (policy,reference,...)"

    def _model_pids(self) -> dict[int, str]:
        path = self.run_dir / "placement.json"
        if not path.exists():
            return {}
        try:
            ranks = json.loads(path.read_text())["ranks"]
        except (ValueError, KeyError):
            return {}  # being written
        names: dict[int, list[str]] = {}
        for model, reps in ranks.items():
            for rep in reps:
                for rank in rep:
                    names.setdefault(rank["pid"], []).append(model)
        return {pid: "model process (" + ",".join(ms) + ")" for pid, ms in names.items()}

    def _group(self, proc: psutil.Process) -> str:
        """The plot's line a process belongs to (the JSON keeps each process apart)."""
        if proc.pid in self.models:
            return self.models[proc.pid]
        try:
            cmd = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return "Ray services"
        if "prefect server start" in cmd:
            return "Prefect server"
        if "default_worker.py" in cmd or (cmd.startswith("ray::") and "Agent" not in cmd):
            return WORKERS  # the raylet's command line names the worker script
        return "Ray services"  # GCS, dashboard and its agents, monitors, the reaper

    def snapshot(self) -> tuple[dict[str, float], dict[str, float], dict[str, dict]]:
        """RSS (MB) and CPU seconds so far per plot line, and each process by pid."""
        rss: dict[str, float] = {}
        cpu: dict[str, float] = {}
        each: dict[str, dict] = {}
        try:
            procs = [(self.driver, "driver")] + [(c, None) for c in self.driver.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for proc, group in procs:
            try:
                with proc.oneshot():
                    mb = proc.memory_info().rss / 2**20
                    t = proc.cpu_times()
                    name = proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            group = group or self._group(proc)
            rss[group] = rss.get(group, 0.0) + mb
            cpu[group] = cpu.get(group, 0.0) + t.user + t.system
            each[str(proc.pid)] = {"group": group, "name": name, "rss_mb": round(mb, 1)}
        return rss, cpu, each

    def run(self) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        seen = 0
        while not self.stop.is_set():
            if not self.models:
                self.models = self._model_pids()
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if len(lines) > seen:
                snap, cpu, each = self.snapshot()
                for line in lines[seen:]:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        break  # half written: read again next poll
                    self.rows.append({"episode": row.get("episode", len(self.rows) + 1), "rss_mb": snap,
                                      "cpu_seconds": cpu, "processes": each,
                                      "peak_memory_mb": row.get("peak_memory_mb"),
                                      "episode_seconds": row.get("episode_seconds")})
                    seen += 1
                    print(f"episode {len(self.rows)}: " + ", ".join(f"{k} {v:.0f}" for k, v in snap.items())
                          + f", peak {row.get('peak_memory_mb', 0):.0f} MB", file=sys.stderr, flush=True)
            time.sleep(POLL_S)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else float("nan")


def summarize(rows: list[dict], warmup: int) -> dict[str, dict]:
    """Per plot line: RSS at episode 1, at the end of warm-up and at the last episode, its maximum, the slope
    from the end of warm-up on, and the CPU seconds an episode took after warm-up (all its processes)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for i, row in enumerate(rows, 1):
        for name, mb in row["rss_mb"].items():
            series.setdefault(name, []).append((i, mb))
    peaks = [(i, r["peak_memory_mb"]) for i, r in enumerate(rows, 1) if r["peak_memory_mb"] is not None]
    if peaks:
        series[PEAK] = peaks
    out = {}
    for name, pts in series.items():
        after = [(i, mb) for i, mb in pts if i >= warmup]
        cpu = [r["cpu_seconds"][name] for r in rows[warmup - 1:] if name in r.get("cpu_seconds", {})]
        out[name] = {"first_mb": pts[0][1], "warmup_end_mb": after[0][1] if after else float("nan"),
                     "last_mb": pts[-1][1], "max_mb": max(mb for _, mb in pts),
                     "slope_mb_per_episode": slope([i for i, _ in after], [mb for _, mb in after]),
                     "cpu_seconds_per_episode": (cpu[-1] - cpu[0]) / (len(cpu) - 1) if len(cpu) > 1 else None}
    return out


def title(unbounded: bool) -> str:
    return (f"{CONFIG} + tied GQA Qwen2, bf16, continuous, packing, LoRA, RLOO, CISPO, checkpoint every episode"
            + (" [oneDNN's default kernel caches]" if unbounded else ""))


def plot(rows: list[dict], warmup: int, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({k for r in rows for k in r["rss_mb"]})
    fig, ax = plt.subplots(figsize=(9, 6))
    for name in names:
        pts = [(i, r["rss_mb"][name]) for i, r in enumerate(rows, 1) if name in r["rss_mb"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{name} RSS")
    peaks = [(i, r["peak_memory_mb"]) for i, r in enumerate(rows, 1) if r["peak_memory_mb"] is not None]
    if peaks:
        ax.plot([p[0] for p in peaks], [p[1] for p in peaks], "k--", lw=1,
                label="peak_memory_mb (largest model process's high-water mark)")
    ax.axvline(warmup, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("episode")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.11, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20, help="episodes before the slope is fitted")
    ap.add_argument("--tag", default="", help="write memory_soak-TAG.* instead of memory_soak.*")
    ap.add_argument("--override", action="append", default=[], help="a config override K=V (repeatable)")
    ap.add_argument("--unbounded", action="store_true",
                    help="oneDNN's default kernel caches (1,024 entries each): the growth before the bound")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (checkpoints included)")
    args = ap.parse_args()

    overrides = _merge(OVERRIDES, [f"runtime.num_episode={args.episodes}", *args.override])
    work = Path(tempfile.mkdtemp(prefix="bench-memory-soak-"))
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(work / "prefect"))
    env.pop("PREFECT_API_URL", None)
    if args.unbounded:  # in the environment, the model processes keep them (chatlearn.models.precision)
        env.update({var: "1024" for var in CACHE_VARIABLES})
    cmd = [str(REPO / ".venv" / "bin" / "chatlearn"), "train", CONFIG, f"runtime.output_dir={work}", *overrides]
    print(" ".join(cmd), file=sys.stderr)
    log = open(work / "train.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    sampler = Sampler(psutil.Process(proc.pid), work / EXP)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    rc = proc.wait()
    wall = time.perf_counter() - t0
    time.sleep(2 * POLL_S)
    sampler.stop.set()
    thread.join()
    log.close()
    if rc != 0:
        sys.stderr.write((work / "train.log").read_text()[-4000:])
        raise SystemExit(f"chatlearn train failed with {rc} (work folder {work})")
    rows = sampler.rows
    summary = summarize(rows, args.warmup)
    print(f"{len(rows)} episodes in {wall / 60:.1f} min; RSS per process (MB), slope fitted from episode "
          f"{args.warmup} on")
    print(f"{'process':52s} {'ep 1':>7s} {'ep ' + str(args.warmup):>7s} {'last':>7s} {'max':>7s} {'MB/ep':>8s} "
          f"{'cpu s/ep':>8s}")
    for name, s in summary.items():
        cpu = f"{s['cpu_seconds_per_episode']:8.2f}" if s["cpu_seconds_per_episode"] is not None else f"{'':8s}"
        print(f"{name:52s} {s['first_mb']:7.0f} {s['warmup_end_mb']:7.0f} {s['last_mb']:7.0f} {s['max_mb']:7.0f} "
              f"{s['slope_mb_per_episode']:8.3f} {cpu}")
    stem = "memory_soak" + (f"-{args.tag}" if args.tag else "")
    results = REPO / "bench" / "results"
    out = {"config": CONFIG, "overrides": overrides, "unbounded_kernel_caches": args.unbounded,
           "episodes": len(rows), "warmup": args.warmup,
           "wall_seconds": wall, "machine": f"{os.cpu_count()} CPUs", "summary": summary, "per_episode": rows}
    (results / f"{stem}.json").write_text(json.dumps(out, indent=1))
    plot(rows, args.warmup, results / f"{stem}.png", title(args.unbounded))
    print(f"wrote bench/results/{stem}.json and .png")
    if not args.keep:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work folder kept: {work}")


if __name__ == "__main__":
    main()
