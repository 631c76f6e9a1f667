"""Soak: does a long run that is SIGKILLed again and again, driver and model processes alike, still end with the
weights of a run nobody touched? And what do the kills cost?

Two runs of the real `chatlearn train` on the embedded default (PPO on the tiny Llama, CPU) at small episodes
(32 samples, a data checkpoint every episode, no eval), one after the other, sharing one Prefect server
(`chatlearn server`, started here for the whole benchmark) and one tiny model directory:

    undisturbed   the command once, in a fresh output folder
    disturbed     the same command in another one, under a supervisor that, at seeded random moments,
                  SIGKILLs the driver (the `chatlearn train` process itself: the supervisor then starts the same
                  command again, which resumes from the last data checkpoint) or the model worker process whose
                  pid `run_dir/placement.json` names (the driver notices, recreates the model processes and
                  resumes by itself: `runtime.max_restarts` is set high so that never runs out), SIGKILLs the
                  Prefect server (the run, and `chatlearn server`, start it again on the same database; the run
                  goes on meanwhile), or stalls a stage: SIGSTOPs the model worker process for `--stall-seconds`,
                  longer than the soak's `runtime.stage_timeout_s` (the run ends with the stage's timeout error
                  or recovers the process it cannot reach, and the supervisor starts it again if it exited), then
                  SIGCONTs it. It loops until the command exits 0.

A kill's moment: when `metrics.jsonl` reaches a randomly chosen number of rows (spread over the run), plus a
random delay (0 to `--max-delay` s, about one episode here, so kills land in generate, score, train, sync,
checkpoint and between episodes); a model-process kill also waits until the driver said `ready to train` since
its last (re)start, and only ever kills a pid in the current driver's process tree.

Measured: driver kills and the resumes after them, model-process kills and the recoveries the driver announced
(`recreating the model processes` on its stderr), restarts that failed (non-zero exits we did not cause, with
their last stderr lines), stalls (no output for `--stall-timeout` s), processes of a killed driver still alive
30 s after the kill, the seconds from each kill to the next `ready to train`, completed episodes computed again,
each run's wall time; then whether the final policies are equal tensor for tensor (`torch.equal`) and whether the
`metrics.jsonl` rows are equal but for timing keys (as tests/test_resume.py compares them). Resume is meant to be
exact, so anything but equal is a bug. Every kill is logged (time, kind, rows, stage, pid, resume point) so a
broken equality can be traced to the kill that broke it.

Prints a table and writes `bench/results/soak.json`. A benchmark, never run by CI: at 200 episodes, about 15
minutes undisturbed and 40 disturbed on a loaded 2-core machine (the wall times depend on its load far more than
on the kills). The work folder (logs of every start, metrics, final weights) is kept; checkpoints are deleted.

    .venv/bin/python bench/soak.py [--episodes 200] [--driver-kills 6] [--actor-kills 6] [--server-kills 3]
                                   [--stalls 2] [--seed 0]
"""

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO  # noqa: E402  (bench/ is a folder of scripts, not a package)

STAGE_TIMEOUT_S = 60.0  # the soak's runtime.stage_timeout_s: a stall fault stops the worker longer than this
SOAK_CONFIG = [
    "runtime.sample_per_episode=32", "runtime.generation_batch_size=16", "runtime.train_micro_batch_size=8",
    "runtime.train_global_batch_size=16", "runtime.save_episode_interval=1", "runtime.eval_episode_interval=0",
    "runtime.enable_eval_before_training=false", "runtime.max_restarts=1000",
    f"runtime.stage_timeout_s={STAGE_TIMEOUT_S:g}",
]
EXP = "default"  # the embedded default's runtime.exp_name: run_dir = CHATLEARN_OUTPUT_DIR/default
TIMING = ("episode_seconds", "stage_seconds", "peak_memory_mb", "startup_seconds")  # as tests/test_resume.py
RECOVERY = "recreating the model processes"  # on a `chatlearn: warning:` line (Prefect's log repeats it)
READY = "ready to train in "
API_LINE = re.compile(r"chatlearn: (?:warning: )?the Prefect API at \S+ (does not answer|answers again|failed a call)")
RESUMED = re.compile(r"resuming after episode (\d+) ")
DIED = re.compile(r"died (?:during episode (\d+)|while starting)")
EPISODE_LINE = re.compile(r"\[episode (\d+)/\d+\]")
EPISODE_START = re.compile(r"Beginning subflow run 'episode-(\d+)'")
TASK_DONE = re.compile(r"Task run '(\w+)-\w+' - Finished")
EPISODE_DONE = re.compile(r"Flow run 'episode-\d+' - Finished")
PREFECT_LINE = re.compile(r"\d\d:\d\d:\d\d\.\d{3} \| ")  # a log line glued to the progress bar's last state
NEXT_STAGE = {"generate": "score", "score": "train", "train": "sync", "sync": "checkpoint",
              "checkpoint": "end of episode"}
ORPHAN_CHECKS_S = (30.0, 120.0)  # processes of a killed driver still alive then are recorded; ended at the last
POLL_S = 0.5


def now() -> float:
    return time.monotonic()


@dataclass
class Attempt:
    """One start of the command: its process, its log files and what its output said, with times (monotonic)."""

    index: int
    proc: subprocess.Popen
    started: float
    stdout: Path
    stderr: Path
    ready: list[float] = field(default_factory=list)
    recoveries: list[tuple[float, str]] = field(default_factory=list)
    api_lines: list[tuple[float, str]] = field(default_factory=list)  # the run's lines about the Prefect API
    resumes: list[tuple[float, int]] = field(default_factory=list)
    episodes_done: list[tuple[float, int]] = field(default_factory=list)
    episode_starts: list[tuple[float, int]] = field(default_factory=list)
    last_lines: deque = field(default_factory=lambda: deque(maxlen=40))
    stage: str = "startup"
    last_output: float = 0.0
    killed_by_us: str | None = None  # "driver kill" / "stall" / "time limit"
    stalled_by_us: bool = False  # a stall fault was delivered: a non-zero exit after it is ours
    returncode: int | None = None
    ended: float | None = None
    _offsets: dict[str, int] = field(default_factory=lambda: {"out": 0, "err": 0})
    _rest: dict[str, str] = field(default_factory=lambda: {"out": "", "err": ""})

    def scan(self) -> None:
        """Read what the command wrote since the last scan (stdout and stderr files)."""
        t = now()
        for key, path in (("out", self.stdout), ("err", self.stderr)):
            with contextlib.suppress(OSError), path.open("rb") as f:
                f.seek(self._offsets[key])
                data = f.read()
            if not data:
                continue
            self._offsets[key] += len(data)
            self.last_output = t
            text = self._rest[key] + data.decode("utf-8", "replace")
            *lines, self._rest[key] = re.split(r"[\r\n]", text)
            for line in lines:
                self._line(t, line)

    def _line(self, t: float, line: str) -> None:
        if line.lstrip().startswith("episodes:"):  # the progress bar, maybe with a log line after it
            m = PREFECT_LINE.search(line)
            ours = line.find("chatlearn: ")  # or with one of ours (a warning from another thread)
            line = line[m.start():] if m else line[ours:] if ours >= 0 else ""
        if not line.strip():
            return
        self.last_lines.append(line)
        if READY in line:
            self.ready.append(t)
            self.stage = "between episodes"
        if RECOVERY in line and line.startswith("chatlearn: warning:"):
            self.recoveries.append((t, line))
        if API_LINE.match(line):
            self.api_lines.append((t, line))
        if m := RESUMED.match(line):
            self.resumes.append((t, int(m.group(1))))
        if m := EPISODE_LINE.search(line):  # stdout: its order against stderr's lines is not known
            self.episodes_done.append((t, int(m.group(1))))
        if EPISODE_DONE.search(line):
            self.stage = "between episodes"
        if m := EPISODE_START.search(line):
            self.episode_starts.append((t, int(m.group(1))))
            self.stage = "generate"
        if m := TASK_DONE.search(line):
            self.stage = NEXT_STAGE.get(m.group(1), f"after {m.group(1)}")
        if RECOVERY in line or RESUMED.match(line):
            self.stage = "startup"

    def is_ready(self) -> bool:
        """Said `ready to train` since its last (re)start of the model processes."""
        return len(self.ready) > len(self.recoveries)

    def tail(self, n: int = 25) -> list[str]:
        return [line[:300] for line in list(self.last_lines)[-n:]]


@dataclass
class Kill:
    """One planned kill: when (`rows` of metrics.jsonl, then `delay` s), of what, and what happened."""

    index: int
    kind: str  # "driver" | "actor" | "server" | "stall"
    rows: int
    delay: float
    pick: float  # which worker pid, for an actor kill (a fraction of the sorted pid list)
    due: float | None = None
    waited: int = 0
    record: dict[str, Any] = field(default_factory=dict)


def count_rows(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def tree_of(pid: int) -> list[tuple[int, float, str]]:
    """(pid, create time, command) of `pid`'s descendants."""
    out = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                out.append((child.pid, child.create_time(), " ".join(child.cmdline())[:160] or child.name()))
    return out


def alive(pid: int, created: float) -> bool:
    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Supervisor:
    """Runs the command until it exits 0, delivering the planned kills; collects what happened."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], out: Path, logs: Path,
                 kills: list[Kill], stall_timeout: float, max_failures: int, deadline: float | None,
                 stall_seconds: float = 0.0) -> None:
        self.name, self.cmd, self.env, self.out, self.logs = name, cmd, env, out, logs
        self.run_dir = out / EXP
        self.kills = kills
        self.stall_timeout, self.max_failures, self.deadline = stall_timeout, max_failures, deadline
        self.stall_seconds = stall_seconds
        self.stopped: list[tuple[float, int]] = []  # (when to SIGCONT, pid) of stall faults
        self.attempts: list[Attempt] = []
        self.failures: list[dict[str, Any]] = []
        self.stalls: list[dict[str, Any]] = []
        self.orphan_checks: list[tuple[float, float, Kill, list[tuple[int, float, str]]]] = []
        self.started: float | None = None
        self.finished: float | None = None
        self.outcome = "not started"

    def rel(self, t: float) -> float:
        return round(t - (self.started or 0.0), 2)

    def say(self, msg: str) -> None:
        print(f"[soak {self.name} {time.strftime('%H:%M:%S')} +{self.rel(now()):7.1f}s] {msg}", flush=True)

    def start(self) -> Attempt:
        i = len(self.attempts)
        stdout, stderr = self.logs / f"{self.name}-{i:02d}.stdout", self.logs / f"{self.name}-{i:02d}.stderr"
        with stdout.open("wb") as fo, stderr.open("wb") as fe:
            proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=fo, stderr=fe,
                                    stdin=subprocess.DEVNULL)
        attempt = Attempt(i, proc, now(), stdout, stderr, last_output=now())
        self.attempts.append(attempt)
        self.say(f"attempt {i} started (pid {proc.pid}), metrics rows {count_rows(self.run_dir)}")
        return attempt

    def run(self) -> None:
        self.started = now()
        self.outcome = "running"
        try:
            while True:
                attempt = self.start()
                while attempt.proc.poll() is None:
                    time.sleep(POLL_S)
                    attempt.scan()
                    self._orphans()
                    self._kills(attempt)
                    self._resume_stopped()
                    self._stall(attempt)
                    if self.deadline is not None and now() > self.deadline:
                        self.say("time limit reached: stopping the run")
                        self._kill_driver(attempt, "time limit")
                        attempt.proc.wait()
                        self.outcome = "time limit"
                        return
                attempt.returncode, attempt.ended = attempt.proc.returncode, now()
                attempt.scan()
                self.say(f"attempt {attempt.index} exited {attempt.returncode}"
                         + (f" ({attempt.killed_by_us})" if attempt.killed_by_us else ""))
                if attempt.returncode == 0:
                    self.outcome = "completed"
                    return
                if attempt.stalled_by_us and not attempt.killed_by_us:
                    attempt.killed_by_us = "stall fault"
                self._resume_stopped(force=True)
                if attempt.killed_by_us:
                    continue
                self.failures.append({"attempt": attempt.index, "t": self.rel(attempt.ended),
                                      "returncode": attempt.returncode, "rows": count_rows(self.run_dir),
                                      "stderr_tail": attempt.tail()})
                self.say(f"FAILED restart: exit {attempt.returncode}; last lines:\n    "
                         + "\n    ".join(attempt.tail(8)))
                if len(self.failures) > self.max_failures:
                    self.outcome = "too many failures"
                    return
                time.sleep(2.0)
        finally:
            self.finished = now()
            for attempt in self.attempts:  # never leave a driver behind (an exception, Ctrl-C)
                if attempt.proc.poll() is None:
                    attempt.proc.kill()
                    attempt.proc.wait()
            deadline = now() + ORPHAN_CHECKS_S[-1] + 1
            while self.orphan_checks and now() < deadline:
                time.sleep(POLL_S)
                self._orphans()
            self._orphans(force=True)

    def _kill_driver(self, attempt: Attempt, why: str) -> list[tuple[int, float, str]]:
        tree = tree_of(attempt.proc.pid)
        attempt.killed_by_us = why
        with contextlib.suppress(ProcessLookupError):
            os.kill(attempt.proc.pid, signal.SIGKILL)
        return tree

    def _kills(self, attempt: Attempt) -> None:
        pending = next((k for k in self.kills if not k.record), None)
        if pending is None:
            return
        rows = count_rows(self.run_dir)
        if pending.due is None:
            if rows >= pending.rows and (pending.kind in ("driver", "server") or attempt.is_ready()):
                pending.due = now() + pending.delay
            return
        if now() < pending.due:
            return
        t = now()
        rec: dict[str, Any] = {"index": pending.index, "kind": pending.kind, "t": self.rel(t),
                               "time": datetime.datetime.now().isoformat(timespec="milliseconds"),
                               "planned_rows": pending.rows, "delay_s": round(pending.delay, 2),
                               "attempt": attempt.index, "rows_at_kill": rows, "stage": attempt.stage,
                               "last_log_line": (attempt.tail(1) or [""])[0][:200]}
        if pending.kind == "driver":
            tree = self._kill_driver(attempt, "driver kill")
            rec["pid"] = attempt.proc.pid
            self.orphan_checks += [(t, t + after, pending, tree) for after in ORPHAN_CHECKS_S]
        elif pending.kind == "server":
            try:
                rec["pid"] = json.loads((Path(self.env["CHATLEARN_PREFECT_HOME"]) / "server.json").read_text())["pid"]
                os.killpg(rec["pid"], signal.SIGKILL)  # the server and its children
            except (OSError, ValueError, KeyError) as exc:
                self._later(pending, rec, f"no live Prefect server to kill for 120 s ({exc})")
                return
            rec["api_lines_before"] = len(attempt.api_lines)
        else:
            if not attempt.is_ready():  # a recovery of its own started meanwhile: wait for it
                pending.due = None
                return
            try:
                ranks = json.loads((self.run_dir / "placement.json").read_text())["ranks"]
            except (OSError, ValueError, KeyError):
                pending.due = now() + 1.0
                return
            pids = sorted({r["pid"] for reps in ranks.values() for rep in reps for r in rep})
            pid = pids[min(len(pids) - 1, int(pending.pick * len(pids)))]
            if pid not in {p for p, _, _ in tree_of(attempt.proc.pid)}:
                # placement.json not rewritten yet: never kill a stranger (nor wait forever)
                self._later(pending, rec, f"pid {pid} of placement.json not in the driver's process tree for 120 s")
                return
            rec["pid"] = pid
            rec["models"] = sorted(m for m, reps in ranks.items() for rep in reps for r in rep if r["pid"] == pid)
            rec["recoveries_before"] = len(attempt.recoveries)
            with contextlib.suppress(ProcessLookupError):
                if pending.kind == "stall":
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped.append((now() + self.stall_seconds, pid))
                    attempt.stalled_by_us = True
                else:
                    os.kill(pid, signal.SIGKILL)
        pending.record = rec
        what = f"SIGSTOP for {self.stall_seconds:.0f}s" if pending.kind == "stall" else "SIGKILL"
        self.say(f"kill {pending.index}: {what} {pending.kind} pid {rec['pid']} at {rows} rows, "
                 f"stage {attempt.stage}")

    @staticmethod
    def _later(pending: Kill, rec: dict[str, Any], skipped: str) -> None:
        """Try the kill again in a second; after 120 tries it is recorded as skipped, for ``skipped``."""
        pending.due = now() + 1.0
        pending.waited += 1
        if pending.waited > 120:
            rec["skipped"] = skipped
            pending.record = rec

    def _resume_stopped(self, force: bool = False) -> None:
        """SIGCONT the workers a stall fault stopped, once their time is up (or now: their driver exited)."""
        keep = []
        for due, pid in self.stopped:
            if now() < due and not force:
                keep.append((due, pid))
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped = keep

    def _stall(self, attempt: Attempt) -> None:
        if now() - attempt.last_output > self.stall_timeout:
            self.say(f"attempt {attempt.index}: no output for {self.stall_timeout:.0f}s, killing it")
            self.stalls.append({"attempt": attempt.index, "t": self.rel(now()), "rows": count_rows(self.run_dir),
                                "stage": attempt.stage, "stderr_tail": attempt.tail()})
            self._kill_driver(attempt, "stall")

    def _orphans(self, force: bool = False) -> None:
        """Processes of a killed driver still alive ORPHAN_CHECKS_S after the kill: recorded; ended (they are
        ours) at the last check, or at the end of the run."""
        keep = []
        for killed, due, kill, tree in self.orphan_checks:
            if now() < due and not force:
                keep.append((killed, due, kill, tree))
                continue
            after = round(due - killed)
            survivors = [(pid, created, cmd.strip()) for pid, created, cmd in tree if alive(pid, created)]
            kill.record[f"survivors_after_{after}s"] = [f"{pid} {cmd}" for pid, _, cmd in survivors]
            last = after == ORPHAN_CHECKS_S[-1] or force
            if last:
                for pid, created, _ in survivors:
                    if alive(pid, created):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
            if survivors:
                self.say(f"kill {kill.index}: {len(survivors)} process(es) of the killed driver still alive "
                         f"{now() - killed:.0f}s after it ({', '.join(c.split()[0] for _, _, c in survivors)})"
                         + ("; ended now" if last else ""))
        self.orphan_checks = keep

    def summary(self) -> dict[str, Any]:
        """Counts and per-kill outcomes, from the attempts' output."""
        if self.started is None:
            return {"outcome": self.outcome}
        done = [(t, n) for a in self.attempts for t, n in a.episodes_done]
        starts = [(t, n) for a in self.attempts for t, n in a.episode_starts]
        recoveries = [r for a in self.attempts for r in a.recoveries]
        delivered = [k.record for k in self.kills if k.record and "skipped" not in k.record]
        for k in self.kills:
            if not k.record or "skipped" in k.record:
                continue
            rec, t_kill = k.record, self.started + k.record["t"]
            attempt = self.attempts[rec["attempt"]]
            if k.kind == "server":
                after = [(t, line) for t, line in attempt.api_lines[rec["api_lines_before"]:] if t >= t_kill]
                back = next((t for t, line in after if "answers again" in line), None)
                rec["noticed"] = any("answers again" not in line for _, line in after)
                rec["seconds_to_api_back"] = round(back - t_kill, 1) if back is not None else None
            elif k.kind == "driver":
                rec["returncode"] = attempt.returncode
                # the first later start that got as far as its resume point (a start killed before it does not)
                later = self.attempts[rec["attempt"] + 1:]
                resumed = next((a for a in later if a.resumes or a.ready), None)
                if resumed is not None:
                    rec["resumed_after_episode"] = resumed.resumes[0][1] if resumed.resumes else 0
                    rec["resumed_in_attempt"] = resumed.index
                ready = next((a for a in later if a.ready), None)
                rec["seconds_to_ready"] = round(ready.ready[0] - t_kill, 1) if ready else None
            else:  # actor kill or stall: a recovery in the same attempt, or (stall) a restart of the command
                rec["recovered"] = len(attempt.recoveries) > rec["recoveries_before"]
                if k.kind == "stall" and not rec["recovered"]:
                    later = self.attempts[rec["attempt"] + 1:]
                    resumed = next((a for a in later if a.ready), None)
                    rec["restarted"] = attempt.returncode not in (None, 0) and resumed is not None
                    rec["returncode"] = attempt.returncode
                    if resumed is not None:
                        rec["resumed_after_episode"] = resumed.resumes[0][1] if resumed.resumes else 0
                        rec["seconds_to_ready"] = round(resumed.ready[0] - t_kill, 1)
                if rec["recovered"]:
                    t_rec, msg = attempt.recoveries[rec["recoveries_before"]]
                    m = DIED.search(msg)
                    rec["died_during_episode"] = int(m.group(1)) if m and m.group(1) else None
                    rec["recovery_message"] = msg.removeprefix("chatlearn: warning: ")[:300]
                    rec["seconds_to_notice"] = round(t_rec - t_kill, 1)
                    resumes = [n for t, n in attempt.resumes if t >= t_rec]
                    rec["resumed_after_episode"] = resumes[0] if resumes else 0
                    ready = [t for t in attempt.ready if t >= t_rec]
                    rec["seconds_to_ready"] = round(ready[0] - t_kill, 1) if ready else None
            if "resumed_after_episode" in rec:
                rec["completed_episodes_redone"] = rec["rows_at_kill"] - rec["resumed_after_episode"]
        first_ready = [a.ready[0] - a.started for a in self.attempts[:1] if a.ready]
        return {
            "outcome": self.outcome,
            "wall_seconds": round((self.finished or now()) - self.started, 1),
            "attempts": len(self.attempts),
            "first_ready_seconds": round(first_ready[0], 1) if first_ready else None,
            "driver_kills": sum(1 for r in delivered if r["kind"] == "driver"),
            "driver_resumes": sum(1 for a in self.attempts[1:] if a.ready),
            "actor_kills": sum(1 for r in delivered if r["kind"] == "actor"),
            "recoveries_seen": len(recoveries),
            "actor_kills_recovered": sum(1 for r in delivered if r["kind"] == "actor" and r.get("recovered")),
            "server_kills": sum(1 for r in delivered if r["kind"] == "server"),
            "server_kills_noticed": sum(1 for r in delivered if r["kind"] == "server" and r.get("noticed")),
            "server_kills_api_back": sum(1 for r in delivered if r["kind"] == "server"
                                         and r.get("seconds_to_api_back") is not None),
            "stalls_delivered": sum(1 for r in delivered if r["kind"] == "stall"),
            "stalls_recovered_or_restarted": sum(1 for r in delivered if r["kind"] == "stall"
                                                 and (r.get("recovered") or r.get("restarted"))),
            "kills_planned_not_delivered": [k.index for k in self.kills if not k.record or "skipped" in k.record],
            "kills_skipped": [k.record for k in self.kills if "skipped" in k.record],
            "failed_restarts": self.failures,
            "stalls": self.stalls,
            "episodes_completed_total": len(done),
            "episode_starts_total": len(starts),
            "completed_episodes_redone": len(done) - len({n for _, n in done}),
            "episode_starts_redone": len(starts) - len({n for _, n in starts}),
            "seconds_kill_to_ready": [r.get("seconds_to_ready") for r in delivered],
            "orphans_30s_after_driver_kills": sum(len(r.get("survivors_after_30s", [])) for r in delivered),
            "orphans_120s_after_driver_kills": sum(len(r.get("survivors_after_120s", [])) for r in delivered),
            "seconds_to_ready_per_attempt": [round(a.ready[0] - a.started, 1) if a.ready else None
                                             for a in self.attempts],
            "kills": delivered,
            "returncodes": [a.returncode for a in self.attempts],
        }


def start_prefect_server(env: dict[str, str], log: Path, timeout: float = 180.0) -> tuple[subprocess.Popen, str]:
    """`chatlearn server` for the whole benchmark: every run (and every restart) joins it."""
    with log.open("wb") as f:
        proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), "-m", "chatlearn.cli", "server"],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = now() + timeout
    while now() < deadline:
        if m := re.search(r"export PREFECT_API_URL=(\S+)", log.read_text(errors="replace")):
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"`chatlearn server` did not come up; see {log}:\n{log.read_text(errors='replace')[-2000:]}")


def stop_prefect_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def comparable_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without timing keys, paths relative to the run directory (tests/test_resume.py)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if k not in TIMING}
        row["checkpoint_paths"] = {k: os.path.relpath(v, run_dir) for k, v in row.get("checkpoint_paths", {}).items()}
        if "relay_checkpoint" in row:
            row["relay_checkpoint"] = os.path.relpath(row["relay_checkpoint"], run_dir)
        rows.append(row)
    return rows


def compare(ref_dir: Path, soak_dir: Path) -> dict[str, Any]:
    import torch  # lazy: only once both runs ended
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    a_path, b_path = (d / "final" / "policy" / "model.safetensors" for d in (ref_dir, soak_dir))
    if a_path.exists() and b_path.exists():
        a, b = load_file(str(a_path)), load_file(str(b_path))
        differing = sorted(k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k]))
        out["weights_equal"] = a.keys() == b.keys() and not differing
        out["tensors"] = len(a)
        out["tensors_differing"] = differing[:20]
        out["tensors_missing"] = sorted(a.keys() ^ b.keys())
        if differing:
            out["max_abs_diff"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in differing)
    else:
        out["weights_equal"] = None
        out["missing"] = [str(p) for p in (a_path, b_path) if not p.exists()]
    try:
        ra, rb = comparable_rows(ref_dir), comparable_rows(soak_dir)
    except OSError as exc:
        out["metrics_rows_equal"] = None
        out["metrics_error"] = str(exc)
        return out
    out["metrics_rows"] = [len(ra), len(rb)]
    out["metrics_rows_equal"] = ra == rb
    diffs = []
    for x, y in zip(ra, rb, strict=False):
        keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
        if keys:
            diffs.append({"episode": x.get("episode"), "keys": keys})
    out["first_differing_rows"] = diffs[:10]
    out["differing_rows"] = len(diffs)
    return out


def plan_kills(rng: random.Random, episodes: int, driver: int, actor: int, max_delay: float, server: int = 0,
               stall: int = 0) -> list[Kill]:
    n = driver + actor + server + stall
    if n > episodes - 1:
        raise SystemExit(f"{n} kills need more than {episodes} episodes (at most one kill per episode boundary)")
    rows = sorted(rng.sample(range(1, episodes), n))
    kinds = ["driver"] * driver + ["actor"] * actor + ["server"] * server + ["stall"] * stall
    rng.shuffle(kinds)
    return [Kill(i, kind, r, rng.uniform(0.0, max_delay), rng.random())
            for i, (kind, r) in enumerate(zip(kinds, rows, strict=True))]


def table(result: dict[str, Any]) -> str:
    u, d, c = result["undisturbed"], result["disturbed"], result["comparison"]
    ready = [s for s in d.get("seconds_kill_to_ready", []) if s is not None]
    lines = [
        ("episodes", result["episodes"]),
        ("undisturbed: wall seconds", u.get("wall_seconds")),
        ("disturbed: wall seconds", d.get("wall_seconds")),
        ("disturbed: outcome", d.get("outcome")),
        ("driver kills (SIGKILL)", d.get("driver_kills")),
        ("driver resumes (restarts that got ready)", d.get("driver_resumes")),
        ("model-process kills (SIGKILL)", d.get("actor_kills")),
        ("recoveries seen on stderr", d.get("recoveries_seen")),
        ("model-process kills recovered", d.get("actor_kills_recovered")),
        ("Prefect server kills (SIGKILL)", d.get("server_kills")),
        ("  noticed by the run / API back", f"{d.get('server_kills_noticed')} / {d.get('server_kills_api_back')}"),
        ("stalled stages (SIGSTOP past the stage timeout)", d.get("stalls_delivered")),
        ("  recovered or restarted", d.get("stalls_recovered_or_restarted")),
        ("kills planned, not delivered", len(d.get("kills_planned_not_delivered", []))),
        ("failed restarts (non-zero, not ours)", len(d.get("failed_restarts", []))),
        ("stalls", len(d.get("stalls", []))),
        ("processes alive 30 s after a driver kill", d.get("orphans_30s_after_driver_kills")),
        ("processes alive 120 s after a driver kill", d.get("orphans_120s_after_driver_kills")),
        ("completed episodes computed again", d.get("completed_episodes_redone")),
        ("episode starts beyond one per episode", d.get("episode_starts_redone")),
        ("kill -> ready seconds (median)", sorted(ready)[len(ready) // 2] if ready else None),
        ("kill -> ready seconds (max)", max(ready) if ready else None),
        ("final weights equal (torch.equal)", c.get("weights_equal")),
        ("metrics rows equal (but timing)", c.get("metrics_rows_equal")),
    ]
    width = max(len(k) for k, _ in lines)
    out = [f"{'soak':{width}s}  value", "-" * (width + 12)]
    out += [f"{k:{width}s}  {v}" for k, v in lines]
    out.append("")
    out.append(f"{'#':>3} {'kind':6} {'t(s)':>8} {'rows':>5} {'stage':16} {'resumed':>7} {'redone':>6} "
               f"{'ready(s)':>8} note")
    for k in d.get("kills", []):
        note = ""
        if k["kind"] == "actor":
            note = "recovered" if k.get("recovered") else "NO RECOVERY SEEN"
        elif k["kind"] == "server":
            note = (f"API back after {k['seconds_to_api_back']} s" if k.get("seconds_to_api_back") is not None
                    else "API NOT BACK IN THIS ATTEMPT")
        elif k["kind"] == "stall":
            note = ("recovered in-run" if k.get("recovered") else
                    f"exit {k.get('returncode')}, restarted" if k.get("restarted") else "NO RECOVERY SEEN")
        elif k.get("survivors_after_30s"):
            note = (f"{len(k['survivors_after_30s'])} process(es) alive after 30 s, "
                    f"{len(k.get('survivors_after_120s', []))} after 120 s")
        out.append(f"{k['index']:>3} {k['kind']:6} {k['t']:>8.1f} {k['rows_at_kill']:>5} {k['stage'][:16]:16} "
                   f"{str(k.get('resumed_after_episode', '-')):>7} {str(k.get('completed_episodes_redone', '-')):>6} "
                   f"{str(k.get('seconds_to_ready', '-')):>8} {note}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=200, help="runtime.num_episode of both runs (default 200)")
    parser.add_argument("--driver-kills", type=int, default=6, help="SIGKILLs of the driver (default 6)")
    parser.add_argument("--actor-kills", type=int, default=6, help="SIGKILLs of the model worker process (default 6)")
    parser.add_argument("--server-kills", type=int, default=3,
                        help="SIGKILLs of the Prefect server (default 3)")
    parser.add_argument("--stalls", type=int, default=2,
                        help="stalled stages: the model worker SIGSTOPped past the stage timeout (default 2)")
    parser.add_argument("--stall-seconds", type=float, default=STAGE_TIMEOUT_S + 20,
                        help=f"how long a stall lasts (default {STAGE_TIMEOUT_S + 20:.0f} s: past the soak's "
                             f"runtime.stage_timeout_s of {STAGE_TIMEOUT_S:.0f} s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default 0)")
    parser.add_argument("--max-delay", type=float, default=6.0,
                        help="a kill lands 0..this many seconds after its metrics row (default 6: about an episode)")
    parser.add_argument("--stall-timeout", type=float, default=600.0,
                        help="kill and restart a driver silent this long (default 600 s)")
    parser.add_argument("--max-failures", type=int, default=5, help="give up after this many failed restarts")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="minutes for the disturbed run; stop it there and report what it did (default none)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' checkpoints (default: deleted at the "
                                                             "end; logs, metrics and final weights are kept)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    kills = plan_kills(rng, args.episodes, args.driver_kills, args.actor_kills, args.max_delay, args.server_kills,
                       args.stalls)
    root = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    logs = root / "logs"
    logs.mkdir()
    base = dict(os.environ, CHATLEARN_TINY_MODEL_DIR=str(root / "tiny-llama"),
                CHATLEARN_PREFECT_HOME=str(root / "prefect"), PYTHONUNBUFFERED="1")
    for key in ("PREFECT_API_URL", "CHATLEARN_CRASH_AT", "CHATLEARN_KILL_AT", "CHATLEARN_OUTPUT_DIR"):
        base.pop(key, None)
    overrides = [f"runtime.num_episode={args.episodes}", *SOAK_CONFIG]
    cmd = [str(REPO / ".venv" / "bin" / "chatlearn"), "train", *overrides]
    print(f"soak: work folder {root}; kill plan (rows, kind, delay): "
          + ", ".join(f"{k.rows}:{k.kind}:{k.delay:.1f}s" for k in kills), flush=True)

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    server, url = start_prefect_server(base, logs / "prefect-server.log")
    base["PREFECT_API_URL"] = url
    print(f"soak: Prefect server at {url}", flush=True)
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    runs: dict[str, Supervisor] = {}
    interrupted = None
    try:
        for name, run_kills in (("undisturbed", []), ("disturbed", kills)):
            out = root / name
            deadline = now() + 60 * args.time_limit if args.time_limit and name == "disturbed" else None
            runs[name] = sup = Supervisor(name, cmd, dict(base, CHATLEARN_OUTPUT_DIR=str(out)), out, logs,
                                          run_kills, args.stall_timeout, args.max_failures, deadline,
                                          args.stall_seconds)
            sup.run()
            if name == "undisturbed" and sup.outcome != "completed":
                break
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "KeyboardInterrupt"
        print(f"soak: interrupted ({interrupted}); reporting what ran", flush=True)
    finally:
        stop_prefect_server(server)

    empty = Supervisor("none", cmd, base, root / "none", logs, [], 0, 0, None)  # a run that never started
    result: dict[str, Any] = {
        "date": date,
        "seed": args.seed,
        "episodes": args.episodes,
        "driver_kills_planned": args.driver_kills,
        "actor_kills_planned": args.actor_kills,
        "server_kills_planned": args.server_kills,
        "stalls_planned": args.stalls,
        "stall_seconds": args.stall_seconds,
        "max_delay_s": args.max_delay,
        "command": ["chatlearn", "train", *overrides],
        "config_overrides": overrides,
        "interrupted": interrupted,
        "work_folder": str(root),
        "kill_plan": [{"index": k.index, "kind": k.kind, "rows": k.rows, "delay_s": round(k.delay, 2)} for k in kills],
        "undisturbed": runs.get("undisturbed", empty).summary(),
        "disturbed": runs.get("disturbed", empty).summary(),
        "comparison": compare(root / "undisturbed" / EXP, root / "disturbed" / EXP),
    }
    print(table(result), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"soak: wrote {args.out}; logs in {logs}", flush=True)
    if not args.keep:
        for name in ("undisturbed", "disturbed"):
            for sub in ("checkpoints", "data_checkpoints"):
                shutil.rmtree(root / name / EXP / sub, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
