"""Collective parameter sync (issue 9, first piece): bucket plans, and a real gloo broadcast between two
processes that leaves the receiver's tensors equal to the sender's bit for bit."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chatlearn.runtime.param_sync import broadcast_tensors, plan_buckets, specs_of


def state(fill: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"embed": ((64, 32), torch.float32), "norm": ((32,), torch.float32), "big": ((128, 64), torch.float32),
              "half": ((16, 8), torch.bfloat16), "steps": ((5,), torch.int64), "tail": ((3, 3), torch.float32)}
    out = {}
    for name, (shape, dtype) in shapes.items():
        if not fill:
            out[name] = torch.zeros(shape, dtype=dtype)
        elif dtype == torch.int64:
            out[name] = torch.randint(0, 1000, shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g).to(dtype)
    out["strided"] = (torch.randn(8, 6, generator=g) if fill else torch.zeros(8, 6)).t()  # not contiguous
    return out


def test_bucket_plan_keeps_dtypes_apart_and_big_tensors_alone():
    specs = specs_of(state(True))
    plan = plan_buckets(specs, 10_000)
    assert sorted(i for b in plan for i in b) == list(range(len(specs)))
    for b in plan:
        assert len({specs[i][2] for i in b}) == 1
        assert b == list(range(b[0], b[-1] + 1))  # consecutive
    assert [specs[i][0] for i in plan[0]] == ["embed", "norm"]  # 8192 + 128 B fit in 10 000
    assert [specs[i][0] for i in plan[1]] == ["big"]  # 32 KiB > max: alone
    with pytest.raises(ValueError):
        plan_buckets(specs, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, max_bytes: int, coalesce: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60))
    try:
        mine = state(fill=rank == 0)
        storage = {n: t.data_ptr() for n, t in mine.items()}
        stats = broadcast_tensors(mine, src=0, coalesce=coalesce, max_bytes=max_bytes)
        if rank == 1:
            expected = state(fill=True)
            out["equal"] = all(torch.equal(mine[n], expected[n]) for n in expected)
            out["in_place"] = all(mine[n].data_ptr() == storage[n] for n in mine)
            out["stats"] = stats
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("max_bytes,coalesce", [(1024, True), (10_000, True), (1 << 20, True), (1 << 20, False)])
def test_broadcast_between_two_processes_is_bit_exact(max_bytes, coalesce):
    """Buckets smaller than the largest tensor (1 KiB, 10 KB), larger than all of them (1 MiB), and per tensor."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), max_bytes, coalesce, out), nprocs=2, join=True)
        result = dict(out)
    assert result["equal"] and result["in_place"]
    stats = result["stats"]
    specs = specs_of(state(True))
    assert stats["collectives"] == (len(plan_buckets(specs, max_bytes // 2)) if coalesce else len(specs))
    # peak extra memory: one bucket at most max_bytes (a larger tensor goes alone, unstaged); none per tensor
    assert stats["staging_bytes"] <= max_bytes if coalesce else stats["staging_bytes"] == 0
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in state(True).values())


def tied_state(fill: bool) -> dict[str, torch.Tensor]:
    """Tied input/output embeddings: one tensor under two names, with a norm between them."""
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(40, 16, generator=g) if fill else torch.zeros(40, 16)
    return {"embed_tokens.weight": embed, "norm.weight": torch.randn(16, generator=g) if fill else torch.zeros(16),
            "lm_head.weight": embed}


def _tied_worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60))
    try:
        mine = tied_state(fill=rank == 0)
        stats = broadcast_tensors(mine, src=0, max_bytes=1024)  # the 2.5 KiB embedding travels alone
        if rank == 1:
            out["equal"] = all(torch.equal(mine[n], t) for n, t in tied_state(True).items())
            out["tied"] = mine["lm_head.weight"] is mine["embed_tokens.weight"]
            out["stats"] = stats
    finally:
        dist.destroy_process_group()


def test_a_tied_tensor_is_sent_once_and_the_receiver_stays_tied():
    assert [s[0] for s in specs_of(tied_state(True))] == ["embed_tokens.weight", "norm.weight"]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_tied_worker, args=(_free_port(), out), nprocs=2, join=True)
        result = dict(out)
    assert result["equal"] and result["tied"]
    assert result["stats"]["bytes"] == (40 * 16 + 16) * 4 and result["stats"]["collectives"] == 2
