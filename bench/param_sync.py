"""Collective parameter sync against the link's own limit, side by side in one run (issue 9, item 8).

A ~100M-parameter Llama's state dict goes from one sender to two receivers over the framework's own sync
group (a stateless gloo group: `SyncGroup.join`, the code a run uses) by every method `transfer` offers, and
the same bytes go as ONE raw collective of a preallocated flat buffer (the best the transport can do). The
methods are interleaved (A B C ... A B C ...), the first round is a warm-up (first touch of buffers), and
medians are reported: seconds, GB/s per receiver, and the ratio to the raw transfer of the same kind
(broadcast to raw broadcast, p2p to raw sends). Every sync is checked bit-exact (SHA-256 per tensor).

    .venv/bin/python bench/param_sync.py [--rounds 7] [--layers 8] [--nccl]

Writes `bench/results/param_sync.json`. ``--nccl`` runs the same on GPUs (one per process) with NCCL groups,
for a machine that has three GPUs or more; without it, everything is CPU/gloo, as in CI.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from chatlearn.runtime.weights.param_sync import Staging, SyncGroup, digest, specs_of, transfer  # noqa: E402

RESULTS = REPO / "bench" / "results" / "param_sync.json"
METHODS = [  # name, comm, coalesce, bucket MiB
    ("broadcast, 100 MiB buckets", "broadcast", True, 100),
    ("broadcast, 25 MiB buckets", "broadcast", True, 25),
    ("broadcast, per tensor", "broadcast", False, 100),
    ("p2p, 100 MiB buckets", "p2p", True, 100),
    ("p2p, per tensor", "p2p", False, 100),
]


def model_state(layers: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=12,
                      num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # real values, cheaply: one random buffer per tensor (the init scheme does not matter for bandwidth)
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g).to(device) for n, p in model.state_dict().items()}


def worker(rank: int, size: int, port: int, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if args.nccl else "cpu"
    if args.nccl:
        torch.cuda.set_device(rank)
    state = model_state(args.layers, device, seed=0 if rank == 0 else rank + 1)
    names = ["sender"] + [f"receiver{r}" for r in range(1, size)]
    group = SyncGroup.join("bench", "127.0.0.1", port, rank, size, names, timeout_s=300, nccl=args.nccl)
    specs = specs_of(state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    flat = torch.empty(total // 4, dtype=torch.float32, device=device)  # raw: one preallocated buffer
    want = {n: digest(t) for n, t in state.items()} if rank == 0 else None

    def barrier() -> None:
        t = torch.zeros(1, device=device)
        group.broadcast(t)
        if args.nccl:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        if args.nccl:
            torch.cuda.synchronize()
        barrier()
        return time.perf_counter() - t0

    def raw(kind: str) -> None:
        if kind == "broadcast":
            group.broadcast(flat)
        elif rank == 0:
            group.send_all(flat)
        else:
            group.recv(flat)

    times: dict[str, list[float]] = {}
    staging = {name: Staging() for name, *_ in METHODS}  # kept from sync to sync, as a run does
    exact = True
    for rnd in range(args.rounds + 1):
        for kind in ("broadcast", "p2p"):
            t = timed(lambda kind=kind: raw(kind))
            if rnd:
                times.setdefault(f"raw {kind}, one flat buffer", []).append(t)
        for name, comm, coalesce, mb in METHODS:
            if rank:  # receivers start from other values each time: a sync that moved nothing would show
                for t in state.values():
                    t.zero_()
            t = timed(lambda comm=comm, coalesce=coalesce, mb=mb, name=name: transfer(
                specs, group=group, sources=state if rank == 0 else None, targets=None if rank == 0 else state,
                comm=comm, coalesce=coalesce, max_bytes=mb * 2**20, staging=staging[name]))
            if rnd:
                times.setdefault(name, []).append(t)
            if rank:
                sent = out.get("digests")
                if sent is not None:
                    exact = exact and all(digest(v) == sent[n] for n, v in state.items())
        if rank == 0 and rnd == 0:
            out["digests"] = want
    out[f"times{rank}"] = times
    out[f"exact{rank}"] = exact
    out["bytes"] = total
    out["params"] = sum(t.numel() for t in state.values())
    group.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (8: ~106M parameters)")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--nccl", action="store_true", help="GPUs and NCCL instead of CPU and gloo")
    args = ap.parse_args()
    size = args.receivers + 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(size, port, args, out), nprocs=size, join=True)
        res = dict(out)
    gb = res["bytes"] / 1e9
    slowest = {k: [max(res[f"times{r}"][k][i] for r in range(size)) for i in range(args.rounds)]
               for k in res["times0"]}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    rows = []
    for k, t in med.items():
        kind = "p2p" if k.startswith(("p2p", "raw p2p")) else "broadcast"
        rows.append({"method": k, "median_s": round(t, 4), "gb_per_s_per_receiver": round(gb / t, 3),
                     "vs_raw": round(med[f"raw {kind}, one flat buffer"] / t, 3)})
    exact = all(res[f"exact{r}"] for r in range(1, size))
    print(f"{res['params'] / 1e6:.1f}M parameters, {gb:.3f} GB, 1 sender -> {args.receivers} receivers, "
          f"{'NCCL' if args.nccl else 'gloo (CPU)'}, median of {args.rounds} rounds; bit-exact: {exact}")
    print(f"{'method':<34}{'median s':>10}{'GB/s/recv':>11}{'vs raw':>8}")
    for r in rows:
        print(f"{r['method']:<34}{r['median_s']:>10.3f}{r['gb_per_s_per_receiver']:>11.2f}{r['vs_raw']:>8.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"params": res["params"], "bytes": res["bytes"], "receivers": args.receivers,
                                   "transport": "nccl" if args.nccl else "gloo", "rounds": args.rounds,
                                   "bit_exact": exact, "rows": rows,
                                   "cpu_count": os.cpu_count()}, indent=1))
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
