"""What the benchmarks share: running the real `chatlearn train` in a fresh output folder with its own
local Prefect server, and timing it from the outside."""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def on_one_gpu(models: list[str], free_memory: bool = False) -> list[str]:
    """Overrides that put every model on the one CUDA device, colocated in one process; with ``free_memory`` each
    hands its memory over between stages."""
    out = [f"runtime.colocation=['{','.join(models)}']"]
    for m in models:
        out += [f"models.{m}.num_gpu=1", f"models.{m}.gpu_per_process=1"]
        if free_memory:
            out.append(f"models.{m}.free_memory=true")
    return out


def run_command(cmd: list[str], env: dict[str, str], timeout: float | None = None
                ) -> tuple[float, subprocess.CompletedProcess]:
    """Run `cmd` in the repository root, its output captured; returns its wall seconds and the finished process,
    whatever its exit (a bench that records a failed run and goes on). Past `timeout` seconds the command is
    killed and `subprocess.TimeoutExpired` raised."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - t0, proc


def timed_run(cmd: list[str], env: dict[str, str], what: str, timeout: float | None = None) -> float:
    """`run_command`, exiting (showing its stderr) on failure; returns its wall seconds."""
    wall, proc = run_command(cmd, env, timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{what} failed with {proc.returncode}")
    return wall


def run_train(out: Path, overrides: list[str], what: str = "chatlearn train") -> float:
    """Run `chatlearn train runtime.output_dir=OUT ...`; returns its wall seconds, exits on failure."""
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(out / "prefect"))
    env.pop("PREFECT_API_URL", None)
    cmd = [str(REPO / ".venv" / "bin" / "chatlearn"), "train", f"runtime.output_dir={out}", *overrides]
    return timed_run(cmd, env, what)


def run_train_streamed(out: Path, overrides: list[str], what: str = "chatlearn train") -> tuple[float, list]:
    """`run_train`, reading the command's output (stdout and stderr merged) as it comes: returns its wall
    seconds and its lines as (seconds since the command started, text), so a bench can tell when a line
    (`ready to train`, `[episode N/M]`) appeared. Exits on failure."""
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(out / "prefect"))
    env.pop("PREFECT_API_URL", None)
    cmd = [str(REPO / ".venv" / "bin" / "chatlearn"), "train", f"runtime.output_dir={out}", *overrides]
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.perf_counter() - t0, line.rstrip("\n")))
    proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write("\n".join(text for _, text in lines[-60:]) + "\n")
        raise SystemExit(f"{what} failed with {proc.returncode}")
    return wall, lines


def first_line_at(lines: list, marker: str) -> float | None:
    """When the first line holding `marker` appeared (seconds since the command started), or None."""
    return next((t for t, text in lines if marker in text), None)


def import_floor(rounds: int = 5, modules: str = "torch, transformers") -> dict:
    """Seconds of `python -c "import torch, transformers"` in fresh interpreters (the venv's python): the
    floor under any start-up that needs them once. Median, min and max over `rounds`, after one untimed run
    (so the files are in the page cache, as they are for a run after the first)."""
    cmd = [str(REPO / ".venv" / "bin" / "python"), "-c", f"import {modules}"]
    subprocess.run(cmd, check=True, capture_output=True)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return {"modules": modules, "rounds": rounds, "median": statistics.median(times), "min": min(times),
            "max": max(times)}
