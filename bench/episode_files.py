"""How many library files one episode of the embedded default touches, and which: issue 45's "files from `flows/`
to the loss", measured.

Runs `chatlearn train` (the embedded default: PPO on the tiny Llama, all six models colocated in one worker
process) for 4 episodes, as a user runs it, with `bench/episode_trace/` on PYTHONPATH: its `sitecustomize.py`
records in every Python process of the run (the driver, and through the PYTHONPATH the driver hands its Ray
workers: the model process, the stream-dataset actor, the task workers of rule rewards and steps) which functions
of the checkout's `chatlearn/**.py` and `flows/**.py` run, when, and called from where (see that file).

Why 4 episodes: with `eval_episode_interval: 2` and a checkpoint after the last episode, episode 1 is the first
(lazy set-up), 2 evaluates, 3 is plain (no eval, no checkpoint) and 4 evaluates and checkpoints. Episode 3 is
"the default episode"; the others are reported too.

An episode's window is one iteration of the train flow's loop, exactly as the driver recorded it: from the call of
the episode's entry (the outermost function, on the driver's stacks that sent the model calls reaching the loss,
that is called once per episode: today `Subflows.__call__`, the episode subflow) to its next call, so it holds the
episode, its bookkeeping after it (metrics line, trackers, artifacts, a checkpoint's commit) and the next
iteration's start (before-episode hooks). The last episode's window ends at its metrics line (read as it
appears, PYTHONUNBUFFERED=1), without its bookkeeping. Should no such entry be found, every window runs from the
metrics line of the episode before (or the `eval before training` / `ready to train` line) to the episode's own:
a reader's latency off at each end. A function counts when any of its calls falls in the window (exactly: each
process records the first and last call per 100 ms).

What is counted (a file counts when at least one of its functions ran in the window, lambdas, comprehensions and
generators included; a file of which only module or class bodies ran, i.e. imported in the window, counts too and
is marked "import only"; an `__init__.py` counts only so; every file under `chatlearn/` and `flows/` counts,
utilities included; nothing outside them, Prefect, Ray, torch and transformers included):

    all               files of every process of the run
    flows/→loss       the driver's files and the model process's (the process where the loss ran), as issue 45
                      counts them: not the stream-dataset actor's, nor the rule-reward and step task workers'
    driver, model, others   each alone (others: the stream-dataset actor and the task workers)
    driver+loss call  the driver's files and, of the model process, only those that ran during the model calls
                      that reached the loss (the trainer's train call, start to end; not generation, the
                      reference/value/reward forwards or the weight sync)
    episode           the driver's files under the episode's entry: the outermost frame, on the stacks that sent
                      the model calls reaching the loss, that was entered in the window (today
                      `Subflows.__call__`, which runs the episode subflow `flows/episode_flow.py`), and everything
                      it called, directly or not, across the stage tasks' threads (callers are recorded per call;
                      a function called from several places counts under each). Not the train flow's loop
                      around it: the before/after-episode hooks, memory reports, the metrics line, trackers,
                      artifacts (`train_flow.py`, `reporting.py`, `trackers.py`, ...)
    episode+loss call the two above: what the episode runs in the driver and the model process's train call;
                      the definition that gives issue 45's "about 36" (36 in episode 3 at main ad13783)
    call path         only the files on the stacks that lead to the loss: in the model process the stacks at
                      each call of the loss (`--loss`), in the driver the stacks that sent those model calls
                      (`ActorMethod._remote` with the same method and leading text arguments, e.g.
                      `run['ppo_policy', 'train']`), stitched across thread hand-overs (thread pools such as the
                      episode's task runner, and started threads) back to the CLI's main thread
    episode call path the call path from the episode's entry (as in `episode`) down: not the CLI, the engine, the train
                      flow and its loop above it

Prints the counts of every episode, the measured episode's files by process with their number of functions, and
writes it all to `bench/results/episode_files.json` (the measured episode's functions by name, the others' counts).

    .venv/bin/python bench/episode_files.py [--episodes 4] [--measure 3] [--loss FILE:QUALNAME] [overrides]
    .venv/bin/python bench/episode_files.py --check      # also an untraced run: same metrics rows and policy?
    .venv/bin/python bench/episode_files.py --reuse DIR  # analyse an earlier run's traces again (--keep kept it)
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from equivalence import policy_digest, stable  # noqa: E402  (bench/ is a folder of scripts, not a package)

REPO = Path(__file__).resolve().parent.parent
TRACER = REPO / "bench" / "episode_trace"
# the PPO policy loss `ppo_clip` (models.ppo_policy.args_dict.policy_loss, `chatlearn.algorithms.registry`)
DEFAULT_LOSS = ["chatlearn/algorithms/ppo.py:ppo_clipped_policy_loss"]
EPISODE_LINE = re.compile(r"^\[episode (\d+)/(\d+)\]")
START_LINES = ("ready to train", "eval before training")


def run(out: Path, overrides: list[str], loss: list[str] | None) -> tuple[float, int, list[tuple[float, str]]]:
    """`chatlearn train OVERRIDES` with its output under ``out``, traced unless ``loss`` is None (the functions
    whose stacks the recorder keeps); returns its wall seconds, its pid and its output lines, each with the wall
    time it was read at. Exits on failure."""
    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(out), CHATLEARN_TINY_MODEL_DIR=str(out / "tiny-llama"),
               CHATLEARN_PREFECT_HOME=str(out / "prefect"), PYTHONUNBUFFERED="1")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for name in ("PREFECT_API_URL", "PYTHONPATH", "CHATLEARN_CRASH_AT", "CHATLEARN_FAULT_AT", "CHATLEARN_KILL_AT"):
        env.pop(name, None)
    if loss is not None:
        (out / "trace").mkdir(parents=True)
        env.update(PYTHONPATH=str(TRACER), EPISODE_FILES_TRACE_DIR=str(out / "trace"),
                   EPISODE_FILES_ROOTS=os.pathsep.join([str(REPO / "chatlearn"), str(REPO / "flows")]),
                   EPISODE_FILES_STACKS=",".join(loss))
    cmd = [str(REPO / ".venv" / "bin" / "chatlearn"), "train", *overrides]
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.time(), line.rstrip("\n")))
    proc.wait()
    wall = time.perf_counter() - t0
    (out / "output.json").write_text(json.dumps({"pid": proc.pid, "wall_seconds": wall, "lines": lines,
                                                 "loss": loss, "overrides": overrides}))
    if proc.returncode != 0:
        sys.stderr.write("\n".join(text for _, text in lines[-60:]) + "\n")
        raise SystemExit(f"chatlearn train failed with {proc.returncode} (output in {out})")
    return wall, proc.pid, lines


def windows(lines: list[tuple[float, str]]) -> dict[int, tuple[float, float]]:
    """Each episode's (start, end) wall time, 1-based, from the terminal lines (see the module's doc)."""
    start = None
    out = {}
    for t, text in lines:
        if text.startswith(START_LINES):
            start = t
        m = EPISODE_LINE.match(text)
        if m:
            if start is None:
                raise SystemExit(f"no start line before {text!r}")
            out[int(m.group(1))] = (start, t)
            start = t
    return out


class Process:
    """One process's trace (`bench/episode_trace/sitecustomize.py` says what each line holds)."""

    def __init__(self, path: Path):
        self.pid = int(path.stem.split("-")[1])
        self.titles: list[str] = []
        self.codes: dict[int, tuple[str, str, int, str]] = {}  # file, qualified name, line, kind (m, c, f)
        self.calls: list[tuple[int, int, float, float]] = []  # code id, caller (0: none), first and last call
        self.sends: list[tuple[str, tuple, float, tuple]] = []  # method, text arguments, time, stitched stack
        self.stacks: list[tuple[int, tuple, float, tuple]] = []  # entry code id, its text arguments, time, stack
        self.entries: list[tuple[int, tuple, float, float]] = []  # code id, text arguments, start, end
        self.untraced: list[tuple[float, tuple]] = []
        ids = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
        for line in path.read_text().splitlines():
            kind, *f = line.split("\t")
            if kind == "P":
                self.titles.append(f[2])
            elif kind == "C":
                self.codes[int(f[0])] = (f[1], f[2], int(f[3]), f[4])
            elif kind == "E":
                self.calls.append((int(f[0]), 0 if f[1] == "-" else int(f[1]), float(f[4]), float(f[5])))
            elif kind == "R":
                self.sends.append((f[0], tuple(json.loads(f[1])), float(f[2]), ids(f[3])))
            elif kind == "S":
                self.stacks.append((int(f[0]), tuple(json.loads(f[1])), float(f[2]), ids(f[3])))
            elif kind == "X":
                self.entries.append((int(f[0]), tuple(json.loads(f[1])), float(f[2]), float(f[3])))
            elif kind == "U":
                self.untraced.append((float(f[1]), ids(f[2])))
        errors = path.with_suffix(".error")
        self.errors = errors.read_text().splitlines() if errors.exists() else []

    def ray_name(self) -> str | None:
        """The class of a Ray actor, ``task`` for a task worker, None for a process that is not a Ray worker
        (Ray titles its workers ``ray::Class``, ``ray::Class.method``, ``ray::function``, ``ray::IDLE``)."""
        # a named actor's title may carry its name first: ``ray::NAME:Class.method``
        names = [t.split()[0][len("ray::"):].rsplit(":", 1)[-1] for t in self.titles if t.startswith("ray::")]
        if not names:
            return None
        classes = {n.split(".")[0] for n in names if n != "IDLE" and n[:1].isupper()}
        return sorted(classes)[0] if classes else "task"

    def ran(self, a: float, b: float) -> set[int]:
        """The code ids with a call in [a, b] (exact: a record's calls lie within 100 ms, the window is longer)."""
        return {c for c, _, first, last in self.calls if a <= first <= b or a <= last <= b}

    def under(self, roots: set[int], a: float, b: float) -> set[int]:
        """``roots`` and every function they called, directly or not, in [a, b] (the callers recorded per call,
        across thread hand-overs; a function called from several places counts under each)."""
        callees: dict[int, set[int]] = defaultdict(set)
        for c, caller, first, last in self.calls:
            if a <= first <= b or a <= last <= b:
                callees[caller].add(c)
        seen: set[int] = set()
        todo = list(roots)
        while todo:
            c = todo.pop()
            if c not in seen:
                seen.add(c)
                todo += callees.get(c, ())
        return seen

    def file(self, cid: int) -> str:
        return self.codes[cid][0] if cid in self.codes else f"<unnamed code {cid}>"

    def name(self, cid: int) -> str:
        return self.codes[cid][1] if cid in self.codes else f"<unnamed code {cid}>"

    def by_file(self, cids: set[int]) -> dict[str, list[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for c in cids:
            out[self.file(c)].add(self.name(c))
        return {f: sorted(n) for f, n in sorted(out.items())}

    def import_only(self, cids: set[int]) -> list[str]:
        """Files of which only module or class bodies ran: imported in the window, no function of theirs called."""
        kinds: dict[str, set[str]] = defaultdict(set)
        for c in cids:
            kinds[self.file(c)].add(self.codes[c][3] if c in self.codes else "f")
        return sorted(f for f, k in kinds.items() if "f" not in k)


def episode(procs: list[Process], driver: Process, a: float, b: float) -> dict:
    """What ran in [a, b]: per process its files and functions, and the counts of every definition."""
    rows = []
    model_pids: list[int] = []
    call_path: dict[str, set[str]] = defaultdict(set)  # file -> functions on the stacks to the loss
    model_path: dict[str, set[str]] = defaultdict(set)  # the same, the model process's part
    loss_call: dict[str, set[str]] = defaultdict(set)  # file -> functions during the model calls reaching it
    reached: set[tuple[str, tuple]] = set()  # (actor method, text arguments) of the model calls reaching the loss
    for p in procs:
        cids = p.ran(a, b)
        if not cids:
            continue
        at_loss = [(entry, args, stack) for entry, args, t, stack in p.stacks if a <= t <= b]
        if at_loss:
            model_pids.append(p.pid)
            inside: set[int] = set()
            for entry, args, stack in at_loss:
                reached.add((p.name(entry).rsplit(".", 1)[-1], args))
                for c in stack:
                    model_path[p.file(c)].add(p.name(c))
                # the model call that reached the loss, start to end: what ran meanwhile is its own (Ray runs one
                # call at a time in this process: `max_concurrency=1`)
                for cid, eargs, start, end in p.entries:
                    if cid == entry and eargs == args and start <= b and end >= a:
                        inside |= p.ran(max(a, start), min(b, end))
            for f, fns in p.by_file(inside).items():
                loss_call[f] |= set(fns)
        ray = p.ray_name()
        role = "driver" if p is driver else f"ray actor {ray}" if ray not in (None, "task") else (
            "ray task worker" if ray == "task" else "other")
        rows.append({"pid": p.pid, "role": role, "title": p.titles[-1][:200] if p.titles else "",
                     "files": p.by_file(cids), "import_only": p.import_only(cids)})
    for row in rows:
        if row["pid"] in model_pids:
            row["role"] = f"model process ({row['role']})"
    sends = [(m, args, stack) for m, args, t, stack in driver.sends if a <= t <= b and (m, args) in reached]
    # the episode's own code in the driver: under the outermost frame of those stacks entered during the window
    # (the loop's call of the episode: today the episode subflow's `Subflows.__call__`)
    ran = driver.ran(a, b)
    starts: set[int] = set()
    episode_path: dict[str, set[str]] = defaultdict(set, {f: set(n) for f, n in model_path.items()})
    call_path = defaultdict(set, {f: set(n) for f, n in model_path.items()})
    for _, _, stack in sends:
        outer = next((i for i in range(len(stack) - 1, -1, -1) if stack[i] in ran), len(stack) - 1)
        starts.add(stack[outer])
        for i, c in enumerate(stack):
            call_path[driver.file(c)].add(driver.name(c))
            if i <= outer:
                episode_path[driver.file(c)].add(driver.name(c))
    in_episode = driver.by_file(driver.under(starts, a, b) & ran)

    def files(keep) -> set[str]:
        return {f for r in rows if keep(r["pid"]) for f in r["files"]}

    is_driver, is_model = (lambda pid: pid == driver.pid), (lambda pid: pid in model_pids)
    driver_files = files(is_driver)
    return {
        "window": [a, b], "seconds": b - a, "processes": rows, "model_pids": model_pids,
        "loss_reached_by": [f"{m}{list(args)}" for m, args in sorted(reached)], "driver_sends_on_path": len(sends),
        "call_path": {f: sorted(n) for f, n in sorted(call_path.items())},
        "episode_call_path": {f: sorted(n) for f, n in sorted(episode_path.items())},
        "loss_call": {f: sorted(n) for f, n in sorted(loss_call.items())},
        "episode_entry": sorted(f"{driver.file(c)}:{driver.name(c)}" for c in starts), "driver_episode": in_episode,
        "counts": {
            "all_files": len(files(lambda pid: True)),
            "flows_to_loss": len(files(lambda pid: is_driver(pid) or is_model(pid))),
            "driver": len(driver_files),
            "model_process": len(files(is_model)),
            "other_processes": len(files(lambda pid: not is_driver(pid) and not is_model(pid))),
            "driver_and_loss_call": len(driver_files | set(loss_call)),
            "driver_episode": len(in_episode),
            "episode_and_loss_call": len(set(in_episode) | set(loss_call)),
            "call_path": len(call_path),
            "episode_call_path": len(episode_path),
        },
    }


def exact_windows(procs: list[Process], driver: Process, lines: list[tuple[float, str]]) -> tuple[dict, str | None]:
    """Each episode's window from the driver's own record: from the call of the episode's entry (the outermost
    function, on the driver's stacks that sent the model calls reaching the loss, called once per episode: today
    `Subflows.__call__`) to its next call; the last episode's ends at its terminal line. Falls back to the
    terminal lines' windows (`windows`) when no such function is found. Returns the windows and the entry."""
    by_lines = windows(lines)
    reached = {(p.name(entry).rsplit(".", 1)[-1], args) for p in procs for entry, args, _, _ in p.stacks}
    calls: dict[int, set[float]] = defaultdict(set)  # code id -> its calls' times (one record per call here)
    for c, _, first, _ in driver.calls:
        calls[c].add(first)
    for method, args, _, stack in driver.sends:
        if (method, args) not in reached:
            continue
        entry = next((c for c in reversed(stack) if len(calls[c]) == len(by_lines)), None)
        if entry is not None:
            starts = sorted(calls[entry])
            eps = sorted(by_lines)
            return ({ep: (starts[i], starts[i + 1] if i + 1 < len(eps) else by_lines[ep][1])
                     for i, ep in enumerate(eps)}, f"{driver.file(entry)}:{driver.name(entry)}")
    return by_lines, None


def analyse(out: Path, pid: int, lines: list[tuple[float, str]]) -> dict:
    procs = [Process(p) for p in sorted((out / "trace").glob("trace-*.tsv"))]
    driver = next((p for p in procs if p.pid == pid), None)
    if driver is None:
        raise SystemExit(f"no trace of the driver (pid {pid}) in {out / 'trace'}")
    wins, entry = exact_windows(procs, driver, lines)
    result: dict = {"windows_from": f"the calls of {entry}" if entry else "the terminal lines",
                    "episodes": {ep: episode(procs, driver, a, b) for ep, (a, b) in sorted(wins.items())}}
    result["untraced_library_frames"] = [
        {"pid": p.pid, "time": t, "frames": [f"{p.file(c)}:{p.name(c)}" for c in stack]}
        for p in procs for t, stack in p.untraced]
    result["recorder_errors"] = {p.pid: p.errors for p in procs if p.errors}
    result["traced_processes"] = [{"pid": p.pid, "ray": p.ray_name(), "title": p.titles[-1][:200] if p.titles else "",
                                   "functions_seen": len(p.codes)} for p in procs]
    return result


DEFINITIONS = (  # (key, column title)
    ("all_files", "all"), ("flows_to_loss", "flows/→loss"), ("driver", "driver"), ("model_process", "model"),
    ("other_processes", "others"), ("driver_and_loss_call", "driver+loss call"), ("driver_episode", "episode"),
    ("episode_and_loss_call", "episode+loss call"), ("call_path", "call path"),
    ("episode_call_path", "episode call path"))


def show(result: dict, measure: int) -> None:
    eps = result["episodes"]
    print(f"library files touched per episode (see the module's doc for each definition; windows from "
          f"{result['windows_from']})")
    print(f"{'episode':>8} {'seconds':>8}" + "".join(f" {title:>{max(7, len(title))}}" for _, title in DEFINITIONS))
    for ep, e in eps.items():
        print(f"{ep:>8} {e['seconds']:>8.1f}" + "".join(f" {e['counts'][key]:>{max(7, len(title))}}"
                                                        for key, title in DEFINITIONS))
    e = eps[measure]
    print(f"\nepisode {measure}: library files by process, with the number of their functions that ran")
    for row in e["processes"]:
        print(f"  {row['role']} (pid {row['pid']}): {len(row['files'])} files")
        for f, fns in row["files"].items():
            marks = ("  [loss call]" if f in e["loss_call"] and row["pid"] in e["model_pids"] else "") + (
                "  [episode]" if f in e["driver_episode"] and row["role"] == "driver" else "") + (
                "  [call path]" if f in e["call_path"] and (row["pid"] in e["model_pids"] or row["role"] == "driver")
                else "") + ("  [import only]" if f in row["import_only"] else "")
            print(f"    {len(fns):>4}  {f}{marks}")
    print(f"\nepisode {measure}: on the call path to the loss, {e['counts']['call_path']} files (the model calls "
          f"reaching it: {', '.join(e['loss_reached_by']) or 'none'}; {e['driver_sends_on_path']} stacks of the driver "
          "sending them)")
    for f, fns in e["call_path"].items():
        print(f"    {f}: {', '.join(fns)}")
    if result["untraced_library_frames"]:
        print(f"\nwarning: {len(result['untraced_library_frames'])} samples of library frames in untraced threads "
              "(see the JSON): their calls are not counted")
    if result["recorder_errors"]:
        print(f"\nwarning: recorder errors: {result['recorder_errors']}")


def check(out: Path, overrides: list[str], traced_out: Path) -> dict:
    """An untraced run of the same config: the same timing-free metrics rows and final policy?"""
    run(out, overrides, None)

    def rows(d: Path) -> list[dict]:
        return [stable(json.loads(x)) for x in (d / "default" / "metrics.jsonl").read_text().splitlines()]

    same_rows = rows(out) == rows(traced_out)
    a, b = policy_digest(out / "default" / "final" / "policy"), policy_digest(traced_out / "default" / "final" /
                                                                              "policy")
    return {"same_metrics_rows": same_rows, "same_final_policy": a == b and a is not None, "policy_sha256": b}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--measure", type=int, default=3, help="the episode the file list is printed for (1-based)")
    ap.add_argument("--loss", action="append", help=f"FILE:QUALNAME of a loss (repeatable; default {DEFAULT_LOSS[0]})")
    ap.add_argument("--check", action="store_true", help="also an untraced run; compare metrics rows and policy")
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (traces, output)")
    ap.add_argument("--reuse", type=Path, help="analyse the traces of a kept folder again, no run")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "episode_files.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    loss = args.loss or DEFAULT_LOSS
    overrides = [f"runtime.num_episode={args.episodes}", *args.overrides]
    t0 = time.perf_counter()
    if args.reuse:  # the loss and overrides are the recorded run's
        out = args.reuse
        saved = json.loads((out / "output.json").read_text())
        wall, pid, lines = saved["wall_seconds"], saved["pid"], [tuple(x) for x in saved["lines"]]
        loss, overrides = saved["loss"], saved["overrides"]
    else:
        out = Path(tempfile.mkdtemp(prefix="bench-episode-files-"))
        wall, pid, lines = run(out, overrides, loss)
    result = analyse(out, pid, lines)
    if args.measure not in result["episodes"]:
        raise SystemExit(f"episode {args.measure} did not run (episodes: {sorted(result['episodes'])})")
    if not result["episodes"][args.measure]["model_pids"]:
        raise SystemExit(f"no process recorded a call of {', '.join(loss)} in episode {args.measure}: is it the "
                         f"loss this config runs, and did the Ray workers load the recorder? (traces in {out})")
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout.strip()

    # the library measured: the last commit that changed it, and whether the checkout has changes of its own
    library = {"commit": git("log", "-1", "--format=%H %s", "--", "chatlearn", "flows")[:120],
               "uncommitted_changes": bool(git("status", "--porcelain", "--", "chatlearn", "flows"))}
    result = {"commit": git("rev-parse", "HEAD"), "library": library,
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "overrides": overrides,
              "loss": loss, "measured_episode": args.measure, "train_wall_seconds": wall, **result}
    show(result, args.measure)
    if args.check:
        untraced = Path(tempfile.mkdtemp(prefix="bench-episode-files-untraced-"))
        verdict = check(untraced, overrides, out)
        if not args.keep:
            shutil.rmtree(untraced, ignore_errors=True)
        result["untraced_run"] = verdict
        print(f"\nuntraced run: same metrics rows {verdict['same_metrics_rows']}, same final policy "
              f"{verdict['same_final_policy']}")
    result["tool_wall_seconds"] = None if args.reuse else time.perf_counter() - t0
    print(f"\nchatlearn train {wall:.0f} s traced" + ("" if args.reuse else
                                                     f"; this tool {result['tool_wall_seconds']:.0f} s in all"))
    for ep, e in result["episodes"].items():  # the functions of the measured episode only; the others' counts
        if ep != args.measure:
            for row in e["processes"]:
                row["files"] = {f: len(fns) for f, fns in row["files"].items()}
            for key in ("call_path", "episode_call_path", "loss_call", "driver_episode"):
                e[key] = sorted(e[key])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.keep or args.reuse:
        print(f"kept: {out}")
    else:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
