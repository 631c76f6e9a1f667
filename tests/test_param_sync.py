"""Collective parameter sync (issue 9, first piece): bucket plans, and a real gloo broadcast between two
processes that leaves the receiver's tensors equal to the sender's bit for bit."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import Replicate, Shard

from chatlearn.runtime.weights.param_sync import broadcast_tensors, plan_buckets, specs_of


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


CASES = [(1024, True), (10_000, True), (1 << 20, True), (1 << 20, False)]


def _worker(rank: int, port: int, out: dict) -> None:
    """Every case of the two tests below, in turn, in one process group: two processes (each a torch import)
    for all of them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60))
    try:
        for max_bytes, coalesce in CASES:
            mine = state(fill=rank == 0)
            storage = {n: t.data_ptr() for n, t in mine.items()}
            stats = broadcast_tensors(mine, src=0, coalesce=coalesce, max_bytes=max_bytes)
            if rank == 1:
                expected = state(fill=True)
                out[max_bytes, coalesce] = dict(equal=all(torch.equal(mine[n], expected[n]) for n in expected),
                                                in_place=all(mine[n].data_ptr() == storage[n] for n in mine),
                                                stats=stats)
        mine = tied_state(fill=rank == 0)
        stats = broadcast_tensors(mine, src=0, max_bytes=1024)  # the 2.5 KiB embedding travels alone
        if rank == 1:
            out["tied"] = dict(equal=all(torch.equal(mine[n], t) for n, t in tied_state(True).items()),
                               tied=mine["lm_head.weight"] is mine["embed_tokens.weight"], stats=stats)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def broadcasts() -> dict:
    """What the receiving process saw in each case of `_worker`."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
        return dict(out)


@pytest.mark.slow
@pytest.mark.parametrize("max_bytes,coalesce", CASES)
def test_broadcast_between_two_processes_is_bit_exact(broadcasts, max_bytes, coalesce):
    """Buckets smaller than the largest tensor (1 KiB, 10 KB), larger than all of them (1 MiB), and per tensor."""
    result = broadcasts[max_bytes, coalesce]
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


@pytest.mark.slow
def test_a_tied_tensor_is_sent_once_and_the_receiver_stays_tied(broadcasts):
    assert [s[0] for s in specs_of(tied_state(True))] == ["embed_tokens.weight", "norm.weight"]
    result = broadcasts["tied"]
    assert result["equal"] and result["tied"]
    assert result["stats"]["bytes"] == (40 * 16 + 16) * 4 and result["stats"]["collectives"] == 2


# Three processes, as a run lays them out: p0 hosts the trainer (plain tensors) and, colocated, rank 0 of a TP 2
# inference replica; p1 is that replica's rank 1; p2 is a second replica in one process, one target strided.
# Buckets of 2 KiB: several staged f32 buckets (the two slots reused), a bf16 one between, and the 2.5 KiB
# embedding and head larger than a bucket (alone, unstaged).
TP_SHAPES = {"embed": ((40, 16), torch.float32, Shard(0)), "head": ((40, 16), torch.float32, Shard(0)),
             **{f"l{i}.{k}": v for i in range(5) for k, v in {
                 "q": ((8, 16), torch.float32, Shard(0)), "o": ((16, 8), torch.float32, Shard(1)),
                 "norm": ((16,), torch.float32, Replicate())}.items()},
             "bias": ((8, 4), torch.bfloat16, Shard(0)), "last": ((4, 4), torch.float32, Replicate())}
TP_MAX_BYTES = 4096  # buckets of half that


def tp_sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype, _) in TP_SHAPES.items()}


def _tp_worker(rank: int, ports: tuple[int, int], out: dict) -> None:
    import datetime

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from chatlearn.models.parallel import full_tensor
    from chatlearn.runtime.weights.param_sync import Staging, SyncGroup, transfer

    torch.set_num_threads(1)
    if rank < 2:  # the TP replica's own world: p0 and p1
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (2,))
        targets = {n: distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [p], src_data_rank=None)
                   for n, (shape, dtype, p) in TP_SHAPES.items()}
    else:
        targets = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype, _) in TP_SHAPES.items()}
        targets["head"] = torch.zeros(16, 40).t()  # strided: received into a temporary buffer, then copied
    sources = tp_sources() if rank == 0 else None
    group = SyncGroup.join("test", "127.0.0.1", ports[1], rank, 3, ["trainer+tp0", "tp1", "replica2"], 60.0)
    specs = specs_of(tp_sources())
    local = {n: (t.to_local() if rank < 2 else t) for n, t in targets.items()}
    storage = {n: t.data_ptr() for n, t in local.items()}
    staging = Staging()  # kept from one sync to the next, as a run does
    try:
        for comm in ("broadcast", "p2p"):
            for t in local.values():
                t.zero_()
            stats = transfer(specs, group=group, sources=sources, targets=targets,
                             comm=comm, max_bytes=TP_MAX_BYTES, debug=True, staging=staging)
            whole = {n: full_tensor(t) for n, t in targets.items()}  # p0 and p1 gather together
            out[f"{comm}{rank}"] = {
                "equal": all(torch.equal(whole[n], t) for n, t in tp_sources().items()),
                "in_place": all(t.data_ptr() == storage[n] for n, t in local.items()),
                "stats": stats}
    finally:
        group.close()
        if rank < 2:
            dist.destroy_process_group()


@pytest.mark.slow
def test_sender_and_receivers_with_buckets_tp_slices_and_a_colocated_rank_are_bit_exact():
    """Bit for bit into every receiver, by broadcast and by p2p, in place; with ``debug`` every receiver's
    digests, the colocated one's too, equal the trainer's (a colocated TP rank once skipped its digests, and
    its TP peer waited for it in ``full_tensor``: the debug hang)."""
    sizes = {n: t.numel() * t.element_size() for n, t in tp_sources().items()}
    specs = specs_of(tp_sources())
    plan = plan_buckets(specs, TP_MAX_BYTES // 2)
    assert sum(len(b) > 1 for b in plan) >= 3 and sizes["embed"] > TP_MAX_BYTES // 2
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = (a.getsockname()[1], b.getsockname()[1])
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_tp_worker, args=(ports, out), nprocs=3, join=True)
        result = dict(out)
    for comm in ("broadcast", "p2p"):
        trainer = result[f"{comm}0"]["stats"]["trainer_digests"]
        assert set(trainer) == set(TP_SHAPES)
        for rank in range(3):
            got = result[f"{comm}{rank}"]
            assert got["equal"] and got["in_place"], (comm, rank)
            assert got["stats"]["receiver_digests"] == trainer, (comm, rank)
            assert got["stats"]["collectives"] == len(plan)
            assert 0 < got["stats"]["staging_bytes"] <= TP_MAX_BYTES


def test_every_built_in_model_syncs_over_the_collective_route():
    """No built-in module class falls back to the object store: overriding get_weights or set_weights without
    sync_sources/sync_targets flips a class to it (`TorchModule.__init_subclass__`), and the policy once did so
    for its rollout engine's hook, putting every policy's sync through Ray's object store (13-17 s an episode on
    Qwen2.5-0.5B's shapes, where the in-process copy takes 0.3 s, and a second copy of the weights in memory)."""
    from chatlearn.runtime.engines import BUILT_IN
    from chatlearn.utils.imports import import_object

    classes = {path: import_object(path) for engine in BUILT_IN.values() for path in engine.module_classes.values()}
    assert "chatlearn.models.hf.policy:PolicyInference" in classes
    assert [path for path, cls in classes.items() if not getattr(cls, "collective_sync", True)] == []


def test_each_route_says_in_a_line_how_the_weights_travel():
    """The line the run logs per (trainer, inference) pair at launch: colocated, mixed, separate, object store."""
    from chatlearn.config import RuntimeConfig
    from chatlearn.runtime.weights.sync import plan_route

    rt = RuntimeConfig()
    colocated = plan_route("ppo_policy", "policy", ["w0"], [["w0"]], True, rt)
    assert colocated.describe() == ("ppo_policy->policy: an in-process copy (every receiving rank is in a trainer "
                                    "process)")
    mixed = plan_route("ppo_policy", "policy", ["w0", "w1"], [["w0", "w1"], ["w2", "w3"]], True, rt)
    assert mixed.members == ["w0", "w2", "w3"]
    assert mixed.describe() == ("ppo_policy->policy: broadcast over a group of 3 processes, 2 receiving ranks in a "
                                "trainer process copying in-process")
    freed = plan_route("t", "p", ["w0"], [["w1"]], True, RuntimeConfig(free_sync_collective_group=True,
                                                                      param_sync_comm_type="p2p"))
    assert freed.describe() == "t->p: p2p over a group of 2 processes (a group joined and left by each sync)"
    own = plan_route("t", "p", ["w0"], [["w1"]], False, rt)
    assert own.members == [] and own.describe() == "t->p: through Ray's object store"


def test_a_sync_into_a_colocated_policy_copies_in_process_and_hands_its_engine_the_weights(tiny_model_dir):
    """The collective route between two models of one process (the trainer's weights into the policy, colocated):
    the policy's weights become the source's bit for bit, and its `weights_synced` hook runs once, inside the
    sync (where the vllm engine pushes them into vLLM); the object-store route's `set_weights` runs it too."""
    from chatlearn.config import ModelConfig, RuntimeConfig
    from chatlearn.models.hf.policy import PolicyInference
    from chatlearn.models.hf.reference import ReferenceModel
    from chatlearn.runtime.cluster.worker import Worker
    from chatlearn.runtime.weights.sync import plan_route

    cfg = ModelConfig(num_cpu=1, args_dict={"model_path": tiny_model_dir})
    worker = Worker([("ppo_policy", ReferenceModel("ppo_policy"), cfg, 0, 0),
                     ("policy", PolicyInference("policy"), cfg, 0, 0)], RuntimeConfig(), 1, {})
    src, dst = (worker.slots[name].module for name in ("ppo_policy", "policy"))
    for module in (src, dst):
        module.setup()  # the host's own setup reads Ray's worker context
    with torch.no_grad():
        for p in src.model.parameters():
            p.add_(torch.randn_like(p))
    handed = []
    dst.rollout.weights_synced = lambda: handed.append(sum(p.sum().item() for p in dst.model.parameters()))
    route = plan_route("ppo_policy", "policy", ["p0"], [["p0"]], True, RuntimeConfig())
    route.specs = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in src.sync_sources().items()]
    stats = worker.sync_weights(route.model_dump(), "p0")
    assert stats["collectives"] == 0 and route.members == []  # nothing left the process
    assert all(torch.equal(dst.model.state_dict()[n], t) for n, t in src.model.state_dict().items())
    assert handed == [sum(p.sum().item() for p in src.model.parameters())]  # once, after the copy
    worker.slots["policy"].set_weights(src.get_weights())
    assert len(handed) == 2
