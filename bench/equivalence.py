"""Behaviour unchanged? Every packaged config (and the rollout modes no packaged config turns on), a few episodes
each as `chatlearn train` runs it: the timing-free metrics rows and the final policy's sha256.

    python bench/equivalence.py --out bench/results/equivalence-BEFORE.json           # at the old commit
    python bench/equivalence.py --out after.json --compare bench/results/equivalence-BEFORE.json

A refactor that claims "behaviour unchanged" runs it at both commits on one machine (on CPU the same config gives
the same weights, bit for bit); ``--compare`` prints each case's verdict and exits 1 on any difference. Not a test:
twelve real runs take about 15 minutes on two cores.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (case, config, overrides): 2-3 episodes reach a checkpoint, an eval and (pipelined) the overlap
CASES: list[tuple[str, str, list[str]]] = [
    ("default", "configs/default.yaml", ["runtime.num_episode=2"]),
    ("default-continuous", "configs/default.yaml", ["runtime.num_episode=2", "runtime.rollout_engine=continuous"]),
    ("grpo", "configs/grpo.yaml", ["runtime.num_episode=2"]),
    ("grpo-async", "configs/grpo_async.yaml", ["runtime.num_episode=3"]),
    # partial rollouts over two rounds of 6 tokens on continuous batching, each response trained as it finishes
    ("grpo-partial", "configs/grpo.yaml", ["runtime.num_episode=3", "runtime.rollout_engine=continuous",
                                           "models.policy.args_dict.max_num_seqs=6",
                                           "models.policy.args_dict.max_new_tokens=12",
                                           "runtime.use_partial_rollout=true",
                                           "runtime.stream_data_loader_type=dynamic",
                                           "runtime.partial_rollout_manager_config.mini_response_per_prompt=0"]),
    ("grpo-math", "configs/grpo_math.yaml", ["runtime.num_episode=2"]),
    ("dapo", "configs/dapo.yaml", ["runtime.num_episode=2"]),
    ("rloo", "configs/rloo.yaml", ["runtime.num_episode=2"]),
    ("reinforce-pp", "configs/reinforce_pp.yaml", ["runtime.num_episode=2"]),
    ("dpo", "configs/dpo.yaml", ["runtime.num_episode=2"]),
    ("online-dpo", "configs/online_dpo.yaml", ["runtime.num_episode=2"]),
    ("agent-higher-lower", "configs/agent_higher_lower.yaml", ["runtime.num_episode=2"]),
    ("agent-calculator", "configs/agent_calculator.yaml", ["runtime.num_episode=2"]),
    ("custom-engine", "examples/custom_engine.yaml", ["runtime.num_episode=2"]),
]

# what differs from run to run on one machine: times, rates, memory, paths
_VOLATILE = ("seconds", "per_s", "_per_sec", "memory", "_mb", "time", "final_policy", "checkpoint", "path",
             "prefect", "url", "startup", "partial_rollouts", "policy_versions")


def stable(row: dict) -> dict:
    """A metrics row without what varies between identical runs (wall times, memory, paths)."""
    return {k: v for k, v in row.items() if not any(p in k for p in _VOLATILE)}


def policy_digest(path: Path) -> str | None:
    """sha256 over the final policy's weight files (names and bytes, in name order)."""
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(path.rglob("*.safetensors")):
        h.update(f.relative_to(path).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def run_case(name: str, config: str, overrides: list[str], work: Path, models: Path) -> dict:
    out = work / name
    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(out), CHATLEARN_TINY_MODEL_DIR=str(models / "tiny-llama"),
               CHATLEARN_TINY_QWEN2_DIR=str(models / "tiny-qwen2"),
               CHATLEARN_TINY_QWEN2_CALCULATOR_DIR=str(models / "tiny-qwen2-calculator"))
    for var in ("CHATLEARN_CRASH_AT", "CHATLEARN_FAULT_AT", "CHATLEARN_KILL_AT"):
        env.pop(var, None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", config, *overrides,
                           f"runtime.output_dir={out}"], cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"ok": False, "seconds": seconds, "error": proc.stderr[-3000:]}
    metrics = sorted(out.rglob("metrics.jsonl"))
    rows = [stable(json.loads(line)) for line in metrics[0].read_text().splitlines()] if metrics else []
    finals = sorted(p for p in out.rglob("final/policy") if p.is_dir())
    return {"ok": True, "seconds": seconds, "rows": rows,
            "final_policy_sha256": policy_digest(finals[0]) if finals else None}


def compare(now: dict, before: dict) -> list[str]:
    lines = []
    for name, case in now.items():
        old = before.get(name)
        if old is not None and old.get("ok") and case.get("ok"):  # an older run may have kept what now is volatile
            old = {**old, "rows": [stable(r) for r in old["rows"]]}
            case = {**case, "rows": [stable(r) for r in case["rows"]]}
        if old is None:
            lines.append(f"{name}: no earlier result")
        elif not case["ok"] or not old["ok"]:
            lines.append(f"{name}: DIFFERENT (a run failed: now {case['ok']}, before {old['ok']})")
        elif case["rows"] != old["rows"] or case["final_policy_sha256"] != old["final_policy_sha256"]:
            pairs = zip(case["rows"], old["rows"], strict=False)
            keys = sorted({k for a, b in pairs for k in {*a, *b} if a.get(k) != b.get(k)})
            same_policy = case["final_policy_sha256"] == old["final_policy_sha256"]
            lines.append(f"{name}: DIFFERENT (rows {len(case['rows'])} vs {len(old['rows'])}, keys {keys[:8]}, "
                         f"policy {'same' if same_policy else 'differs'})")
        else:
            lines.append(f"{name}: same ({len(case['rows'])} rows, policy {str(case['final_policy_sha256'])[:12]})")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write this run's JSON")
    ap.add_argument("--compare", help="an earlier run's JSON: print the verdicts, exit 1 on a difference")
    ap.add_argument("--only", nargs="*", help="these cases only")
    ap.add_argument("--models", help="built tiny models kept between runs (default: a temporary folder)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="equivalence-"))
    models = Path(args.models) if args.models else work / "models"
    results = {}
    print(f"{'case':<22} {'ok':<4} {'rows':>4} {'seconds':>8}  final policy sha256")
    for name, config, overrides in CASES:
        if args.only and name not in args.only:
            continue
        res = results[name] = run_case(name, config, overrides, work, models)
        print(f"{name:<22} {str(res['ok']):<4} {len(res.get('rows', [])):>4} {res['seconds']:>8.1f}  "
              f"{res.get('final_policy_sha256') or res.get('error', '')[-200:]}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare:
        lines = compare(results, json.loads(Path(args.compare).read_text()))
        print("\n".join(lines))
        return 1 if any("DIFFERENT" in line or "no earlier" in line for line in lines) else 0
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
