"""What the benchmarks share: running the real `chatlearn train` in a fresh output folder with its own
local Prefect server, and timing it from the outside."""

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_train(out: Path, overrides: list[str], what: str = "chatlearn train") -> float:
    """Run `chatlearn train runtime.output_dir=OUT ...`; returns its wall seconds, exits on failure."""
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(out / "prefect"))
    env.pop("PREFECT_API_URL", None)
    cmd = [str(REPO / ".venv" / "bin" / "chatlearn"), "train", f"runtime.output_dir={out}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{what} failed with {proc.returncode}")
    return wall
