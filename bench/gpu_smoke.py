"""GPU smoke run: the embedded default (PPO), GRPO on the tiny Qwen2 (tied embeddings, grouped-query
attention), online DPO with LoRA, GRPO in bf16 with continuous batching and packing, and GRPO generating with
vLLM (`configs/grpo_vllm.yaml`; `make setup` installs vLLM's CUDA build where torch is a CUDA one), each with every
model on one CUDA device, colocated in one process, handing memory over between stages (`free_memory`), two
episodes with a checkpoint each. Needs a CUDA device (CI never has one; the CPU runs of the same configs are
the test suite's).

For each run it prints the wall time, the last episode's reward and peak memory, whether the final policy
loads with `from_pretrained` (tied weights still tied for the Qwen2), and the handover per episode; writes
``bench/results/gpu_smoke.json``. Exits 1 if any run fails.

    .venv/bin/python bench/gpu_smoke.py
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, on_one_gpu, run_train  # noqa: E402  (bench/ is a folder of scripts, not a package)

SMALL = ["runtime.num_episode=2", "runtime.sample_per_episode=64", "runtime.generation_batch_size=32",
         "runtime.train_micro_batch_size=16", "runtime.train_global_batch_size=32", "runtime.save_episode_interval=1",
         "runtime.eval_episode_interval=2"]
RUNS = {
    "default (PPO)": ("default", ["policy", "reference", "reward", "value", "ppo_policy", "ppo_value"], []),
    "GRPO, tiny Qwen2": ("grpo", ["policy", "reference", "reward", "ppo_policy"],
                         [f"models.{m}.model_config_file=tiny_qwen2.yaml"
                          for m in ("policy", "reference", "ppo_policy")]),
    "online DPO, LoRA": ("online_dpo", ["policy", "reference", "reward", "ppo_policy"], []),
    # issue 25's modes on CUDA: bf16 (trainer autocast, bf16 inference copies), continuous batching, packing
    "GRPO, bf16+cb+packed": ("grpo", ["policy", "reference", "reward", "ppo_policy"],
                             ["runtime.rollout_engine=continuous", "models.ppo_policy.packing=true",
                              "models.reference.packing=true"]
                             + [f"models.{m}.args_dict.bf16=true" for m in ("policy", "reference", "ppo_policy")]),
    # issue 46: vLLM's CUDA build in the policy's process (KV cache of a fixed size: VLLMEngine.kv_cache_bytes);
    # not run on a GPU yet. Sleep mode between stages and an NCCL sync to a separate replica are still to come
    "GRPO, vllm": ("grpo_vllm", ["policy", "reference", "reward", "ppo_policy"], []),
}


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this smoke run needs a GPU")
    from transformers import AutoModelForCausalLM

    root = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    results, failed = {}, False
    for name, (config, models, extra) in RUNS.items():
        out = root / config
        try:
            wall = run_train(out, [config, *SMALL, *on_one_gpu(models, free_memory=True), *extra], what=name)
            run_dir = next(out.glob("*/metrics.jsonl")).parent  # output_dir/exp_name
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            model = AutoModelForCausalLM.from_pretrained(run_dir / "final" / "policy")
            tied = model.config.tie_word_embeddings and (
                model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr())
            results[name] = {"ok": True, "wall_s": wall, "episodes": len(rows),
                             "reward_mean": rows[-1].get("reward_mean"),
                             "peak_memory_mb": rows[-1].get("peak_memory_mb"),
                             "handover_mb": [r.get("handover_mb") for r in rows], "tied_embeddings": bool(tied)}
        except SystemExit as exc:
            failed = True
            results[name] = {"ok": False, "error": str(exc)}
    print(f"{'run':20s} {'ok':>3s} {'wall s':>7s} {'reward':>8s} {'peak MB':>8s} {'tied':>5s} handover MB/episode")
    for name, r in results.items():
        if r["ok"]:
            print(f"{name:20s} {'yes':>3s} {r['wall_s']:7.1f} {r['reward_mean'] or 0:8.4f} "
                  f"{r['peak_memory_mb'] or 0:8.1f} {str(r['tied_embeddings']):>5s} {r['handover_mb']}")
        else:
            print(f"{name:20s} {'NO':>3s} {r['error']}")
    out = REPO / "bench" / "results" / "gpu_smoke.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "runs": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
