"""Independent calls of a compute flow run at the same time: PPO's reference and value, measured.

Two runs of the embedded default with every model in a worker process of its own (no colocation, one CPU
each), side by side: the built-in RLHF flow, where reference and value both read only the policy's output, and
the same work with value reading the reference's output too (`ChainedRLHF` below), which makes it wait. Same
models, data and seeds, so the same numbers (checked: the rows' rewards and losses agree); only the score
stage's time differs. Prints the median score-stage seconds over episodes 2..N and their ratio, writes
`bench/results/flow_overlap.json`.

    .venv/bin/python bench/flow_overlap.py
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_train  # noqa: E402  (bench/ is a folder of scripts, not a package)

from chatlearn import Engine, Environment, Evaluator, Trainer  # noqa: E402

EPISODES = 6
MODELS = ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")


class ChainedRLHF(Engine):
    """RLHF with value reading the reference's output as well: the same calls, one after the other."""

    def __init__(self, policy, reference, reward, value, ppo_policy, ppo_value):
        def env_flow(batch):
            policy_out = policy.forward_step(batch)
            ref_out = reference.forward_step(policy_out)
            value_out = value.forward_step(policy_out, ref_out)  # waits for the reference
            return reward.forward_step(policy_out, ref_out, value_out)

        def trainer_flow(batch):
            ppo_policy.train_step(batch)
            ppo_value.train_step(batch)

        def eval_flow(batch):
            return reward.eval_forward(policy.eval_forward(batch))

        super().__init__(Environment(env_flow), Trainer(trainer_flow), Evaluator(eval_flow))
        self.set_parameter_sync(ppo_policy, policy)
        self.set_parameter_sync(ppo_value, value)


def run(engine: str) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    layout = [f"models.{m}.{k}=1" for m in MODELS for k in ("num_cpu", "cpu_per_process")]
    run_train(out, ["configs/default.yaml", f"runtime.engine={engine}", "runtime.colocation=[]",
                    f"runtime.num_episode={EPISODES}", "runtime.eval_episode_interval=0",
                    "runtime.enable_eval_before_training=false", "runtime.save_episode_interval=1000",
                    "models.reward.args_dict.advantage_estimator=gae", *layout], what=f"engine {engine}")
    return [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]


def main() -> dict:
    rows = {"parallel (built-in rlhf)": run("rlhf"),
            "chained (value reads reference)": run("bench/flow_overlap.py:ChainedRLHF")}
    (a, b) = rows.values()
    same = all(x[k] == y[k] for x, y in zip(a, b, strict=True) for k in ("reward_mean", "policy_loss", "value_loss"))
    result = {"episodes": EPISODES, "same_numbers": same, "runs": {}}
    for name, rs in rows.items():
        score = [r["stage_seconds"]["score"] for r in rs[1:]]
        result["runs"][name] = {"score_seconds_median": statistics.median(score),
                                "episode_seconds_median": statistics.median(r["episode_seconds"] for r in rs[1:])}
    par, ch = (r["score_seconds_median"] for r in result["runs"].values())
    result["chained_over_parallel_score"] = ch / par
    print(f"{'flow':34} {'score s (median)':>17} {'episode s (median)':>19}")
    for name, r in result["runs"].items():
        print(f"{name:34} {r['score_seconds_median']:17.3f} {r['episode_seconds_median']:19.3f}")
    print(f"score stage, chained / parallel: {result['chained_over_parallel_score']:.2f}x; same numbers: {same}")
    (REPO / "bench" / "results" / "flow_overlap.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
