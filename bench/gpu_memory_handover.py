"""GPU check of the memory handover: how much device memory each offload flag frees, and that onload restores
the model bit for bit. Needs a CUDA device (the CPU path is covered by tests/test_memory.py).

For a Llama of about 100 M parameters with AdamW after one step, it prints `torch.cuda.memory_allocated`
before and after `free_grad_buffers`, `offload_optimizer_states` and `offload_weights` (ChatLearn's order),
then onloads and checks every parameter and optimizer state equals its copy from before. Writes
``bench/results/gpu_memory_handover.json``.

    .venv/bin/python bench/gpu_memory_handover.py
"""

import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chatlearn.models.memory import MemoryManager

REPO = Path(__file__).resolve().parents[1]
FLAGS = [("grads", "free_grad_buffers"), ("optimizer", "offload_optimizer_states"), ("weights", "offload_weights")]


def main() -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs a GPU")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=12, vocab_size=32000, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model(input_ids=ids, labels=ids).loss.backward()  # grads present, as right after a train step
    torch.cuda.synchronize()
    before_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before_opt = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    mm = MemoryManager(model, opt, offload_weights=True, offload_optimizer_states=True, free_grad_buffers=True,
                       bucket_size_mb=1024)
    rows = []
    for part, flag in FLAGS:
        torch.cuda.synchronize()
        a0 = torch.cuda.memory_allocated()
        released = mm.offload([part])[part]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        a1 = torch.cuda.memory_allocated()
        rows.append({"flag": flag, "allocated_before_mb": a0 / 2**20, "allocated_after_mb": a1 / 2**20,
                     "freed_mb": (a0 - a1) / 2**20, "released_by_manager_mb": released / 2**20})
    mm.onload()
    torch.cuda.synchronize()
    same_params = all(torch.equal(before_params[k], v) for k, v in model.state_dict().items())
    same_opt = all(torch.equal(before_opt[id(p)][k], v) for p, s in opt.state.items() for k, v in s.items())
    print(f"{'flag':26s} {'before MB':>10s} {'after MB':>10s} {'freed MB':>10s} {'manager MB':>10s}")
    for r in rows:
        print(f"{r['flag']:26s} {r['allocated_before_mb']:10.1f} {r['allocated_after_mb']:10.1f} "
              f"{r['freed_mb']:10.1f} {r['released_by_manager_mb']:10.1f}")
    print(f"onload restores parameters bit for bit: {same_params}; optimizer states: {same_opt}")
    result = {"device": torch.cuda.get_device_name(), "params": sum(p.numel() for p in model.parameters()),
              "flags": rows, "restored_params_equal": same_params, "restored_optimizer_equal": same_opt}
    out = REPO / "bench" / "results" / "gpu_memory_handover.json"
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["restored_params_equal"] and result["restored_optimizer_equal"] else 1)
