"""Multi-process replicas of the built-in modules (issue 9): data parallel, ZeRO (FSDP2) and tensor parallel
give one process's loss and gradients; sharded checkpoints load into other world sizes; collective param sync
leaves every inference replica equal to the trainer bit for bit, across shardings.

Each layout runs the real `PPOPolicyTrainer` in the framework's worker processes (placement groups, one
torch world per unit, groups per dimension) on gloo, against the same trainer in this process.
"""

import os
import time

import pytest
import ray
import torch

from chatlearn.config import load_config
from chatlearn.models.hf.policy import PolicyInference
from chatlearn.models.hf.ppo_trainer import PPOPolicyTrainer
from chatlearn.models.parallel import ParallelDims, full_tensor, tp_plan
from chatlearn.runtime.calls.waiting import wait
from chatlearn.runtime.cluster.model_group import cluster_nodes, setup_models, start_workers
from chatlearn.runtime.cluster.placement import plan_placement
from chatlearn.runtime.weights.param_sync import SyncError
from chatlearn.runtime.weights.sync import SyncRoute, check_specs, connect, plan_route, sync_routes


def done(call):
    """A replica call's result (rank 0's), every rank waited for, as the stages wait."""
    return wait(call, "test", 600)


class GradProbe(PPOPolicyTrainer):
    """The PPO policy trainer, plus a look at its gradients after a step (whole tensors, gathered)."""

    def grads(self) -> dict[str, torch.Tensor]:
        if self.pipelined:  # each stage has its own layers' gradients: broadcast them from their stage
            ctx, params, out = self.parallel, dict(self.model.named_parameters()), {}
            for stage in range(ctx.dims.pp):
                for n in sorted(ctx.owned[stage]):
                    g = params[n].grad
                    buf = g.detach().clone() if g is not None else torch.zeros_like(params[n])
                    torch.distributed.broadcast(buf, src=ctx.ranks[stage], group=ctx.dim_groups["pp"])
                    out[n] = buf
            return out
        return {n: full_tensor(p.grad).detach().clone() for n, p in self.model.named_parameters()
                if p.grad is not None}

    def tied(self) -> bool:
        return tied(self)


# workers cannot import this test file: ship GradProbe by value
ray.cloudpickle.register_pickle_by_value(__import__(__name__))


def model_args(path: str) -> dict:
    # no clipping: the gradients themselves are compared
    return {"model_path": path, "lr": 1e-3, "max_grad_norm": 1e6, "whiten_advantages": True}


def config(models: dict, run_dir: str):
    return load_config({"models": models, "runtime": {"sample_per_episode": 8, "train_micro_batch_size": 2,
                                                      "train_global_batch_size": 8, "output_dir": run_dir,
                                                      "exp_name": "parallel"}}, checks=[])


def micro_batches(n: int = 4, width: int = 5, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        mask = torch.ones(2, width)
        mask[i % 2, width - 1 - i % 3:] = 0  # ragged responses
        out.append({"prompt_ids": torch.randint(4, 30, (2, 4), generator=g), "prompt_mask": torch.ones(2, 4),
                    "response_ids": torch.randint(4, 30, (2, width), generator=g), "response_mask": mask,
                    "logprobs": -torch.rand(2, width, generator=g) * 3 * mask,
                    "advantages": torch.randn(2, width, generator=g) * mask})
    return out


def single_process_step(cfg, data):
    module = GradProbe("ppo_policy")
    module.bind(cfg.models["ppo_policy"], cfg.runtime, 0, cfg.runtime.seed)
    module.setup()
    stats = module.train_step([dict(mb) for mb in data], 0)
    return module, stats, module.grads()


def start(cfg, modules):
    nodes, ids = cluster_nodes()
    plan = plan_placement(cfg, list(modules), nodes)
    workers = start_workers(plan, ids, cfg, modules)
    setup_models(workers, True, 600)
    return workers


LAYOUTS = {
    "dp2": {"num_cpu": 2},
    "zero2": {"num_cpu": 2, "zero_size": 2},
    "tp2": {"num_cpu": 2, "tensor_model_parallel_size": 2},
    "tp2xdp2": {"num_cpu": 4, "tensor_model_parallel_size": 2},
    "pp2": {"num_cpu": 2, "pipeline_model_parallel_size": 2},
}
# Layouts run on the tiny Qwen2 (tied embeddings: FSDP2 shards the shared weight once, the pipeline's first and
# last stages both use it; 2 KV heads split over TP 2); the others on the default's Llama.
ON_QWEN2 = {"zero2", "tp2", "pp2"}


@pytest.mark.integration
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_gives_one_process_loss_and_gradients(ray_session, tiny_model_dir, tiny_qwen2_dir, tmp_path,
                                                          layout):
    one_process_step(tiny_qwen2_dir if layout in ON_QWEN2 else tiny_model_dir, layout, tmp_path)


# Layouts where another family differs: Qwen3's per-head q/k norms see only a TP rank's heads (their gradients
# are summed over the TP group); Mistral's sliding window in the pipeline stages' own masks.
@pytest.mark.integration
@pytest.mark.parametrize(("arch", "layout"), [("qwen3", "tp2"), ("mistral", "pp2")])
def test_other_families_layouts_give_one_process_loss_and_gradients(ray_session, request, tmp_path, arch, layout):
    # sequences of 4 + 20 tokens: longer than Mistral's 8-token window
    one_process_step(request.getfixturevalue(f"tiny_{arch}_dir"), layout, tmp_path, width=20)


def one_process_step(path, layout, tmp_path, width=5):
    shape = {"trainable": True, "cpu_per_process": 1, "args_dict": model_args(path), **LAYOUTS[layout]}
    cfg = config({"ppo_policy": shape}, str(tmp_path))
    single_cfg = config({"ppo_policy": {**shape, "num_cpu": 1, "zero_size": 1, "tensor_model_parallel_size": 1,
                                        "pipeline_model_parallel_size": 1}}, str(tmp_path))
    data = micro_batches(width=width)
    _, want_stats, want = single_process_step(single_cfg, data)
    workers = start(cfg, {"ppo_policy": GradProbe("ppo_policy")})
    try:
        head = workers.groups["ppo_policy"].heads[0]
        assert len(head.ranks) == shape["num_cpu"]
        stats = done(head.call.remote("train_step", data, 0))
        got = done(head.call.remote("grads"))
    finally:
        workers.kill()
    for key in ("policy_loss", "clipfrac", "approx_kl", "policy_grad_norm"):
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key
    assert got.keys() == want.keys()
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    scale = max(float(want[n].abs().max()) for n in want)
    assert worst <= 1e-6 * max(1.0, scale), f"{layout}: gradients differ by {worst}"


def test_parallel_dims_number_ranks_tp_fastest():
    dims = ParallelDims.of(8, tp=2, zero=2)
    assert (dims.dp, dims.shard, dims.tp) == (2, 2, 2)
    assert dims.coords(5) == {"pp": 0, "dp": 1, "shard": 0, "tp": 1}
    assert dims.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert dims.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    with pytest.raises(ValueError, match="not a multiple"):
        ParallelDims.of(6, tp=4)


def test_the_tp_plan_comes_from_transformers_config(tiny_model_dir):
    from chatlearn.models.hf.common import load_causal_lm

    plan = tp_plan(load_causal_lm(tiny_model_dir))
    assert sorted({type(s).__name__ for s in plan.values()}) == ["ColwiseParallel", "RowwiseParallel"]
    assert len(plan) == 7 * 4  # q, k, v, o, gate, up, down in each of the 4 layers
    assert type(plan["model.layers.0.self_attn.o_proj"]).__name__ == "RowwiseParallel"


def tied(module) -> bool:
    """Whether the module's LM head is still its input embedding (one storage), in the process that holds it."""
    model = module.model
    return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.integration
def test_sharded_checkpoints_load_into_other_world_sizes(ray_session, tiny_qwen2_dir, tmp_path):
    """ZeRO 2 writes a torch distributed checkpoint; it loads into one process and into TP 2, equal. The model
    has tied embeddings: stored once (the manifest names the alias), tied again in every layout that loads it."""
    base = {"trainable": True, "cpu_per_process": 1, "args_dict": model_args(tiny_qwen2_dir)}
    data = micro_batches()
    saved = {}
    for name, layout in (("zero2", {"num_cpu": 2, "zero_size": 2}), ("tp2", {"num_cpu": 2,
                                                                            "tensor_model_parallel_size": 2})):
        cfg = config({"ppo_policy": {**base, **layout}}, str(tmp_path))
        workers = start(cfg, {"ppo_policy": GradProbe("ppo_policy")})
        try:
            head = workers.groups["ppo_policy"].heads[0]
            if name == "zero2":
                done(head.call.remote("train_step", data, 0))
                path = done(head.save_checkpoint.remote(3))
                assert os.path.isfile(os.path.join(path, ".metadata"))
                saved["weights"] = done(head.get_weights.remote())
                stored = torch.distributed.checkpoint.FileSystemReader(path).read_metadata().state_dict_metadata
                assert "model.model.embed_tokens.weight" in stored and "model.lm_head.weight" not in stored
                manifest = __import__("json").loads(open(os.path.join(path, "manifest.json")).read())
                assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
            else:
                done(head.load_checkpoint.remote(3))
                loaded = done(head.get_weights.remote())
                assert all(torch.equal(loaded[k], saved["weights"][k]) for k in saved["weights"])
                assert all(ray.get([r.call.remote("tied") for r in workers.groups["ppo_policy"].replicas[0]]))
        finally:
            workers.kill()
    one = GradProbe("ppo_policy")
    cfg = config({"ppo_policy": {**base, "num_cpu": 1}}, str(tmp_path))
    one.bind(cfg.models["ppo_policy"], cfg.runtime, 0, cfg.runtime.seed)
    one.setup()
    one.load_checkpoint(3)
    weights = one.get_weights()
    assert all(torch.equal(weights[k], saved["weights"][k]) for k in saved["weights"]) and tied(one)
    # the optimizer state came along: one more identical step from both gives the same weights
    assert one.optimizer.state_dict()["state"], "optimizer state not restored"


def _sync_setup(model_dir, tmp_path, comm: str, bucket_mb: float, trainer: str = "zero2", policy_tp: int = 2,
                free: bool = False):
    cfg = load_config({"models": {
        "ppo_policy": {"trainable": True, "cpu_per_process": 1, **LAYOUTS[trainer],
                       "args_dict": model_args(model_dir)},
        "policy": {"num_cpu": 4, "cpu_per_process": 1, "tensor_model_parallel_size": policy_tp,
                   "args_dict": {"model_path": model_dir}}},
        "runtime": {"sample_per_episode": 8, "output_dir": str(tmp_path), "param_sync_comm_type": comm,
                    "coalesced_buffer_mb": 1, "debug": True, "free_sync_collective_group": free}}, checks=[])
    workers = start(cfg, {"ppo_policy": GradProbe("ppo_policy"), "policy": PolicyInference("policy")})
    by_name = {workers.names[p]: a for p, a in workers.actors.items()}
    src, dst = workers.groups["ppo_policy"], workers.groups["policy"]
    route = plan_route("ppo_policy", "policy", [h.process for h in src.replicas[0]],
                       [[h.process for h in rep] for rep in dst.replicas], True, cfg.runtime)
    route.bucket_bytes = int(bucket_mb * 2**20)
    route.timeout_s = 20
    specs = ray.get([by_name[route.src_ranks[0]].sync_specs.remote("ppo_policy", "src"),
                     by_name[route.dst_ranks[0][0]].sync_specs.remote("policy", "dst")])
    route.specs = check_specs(route, *specs)
    if not free:  # a freed group is joined by each sync itself
        connect(route, by_name.__getitem__)
    return workers, by_name, route


@pytest.mark.integration
@pytest.mark.parametrize(("comm", "bucket_mb", "trainer", "policy_tp", "free", "then_kill"), [
    ("broadcast", 0.1, "zero2", 2, False, True), ("p2p", 8.0, "zero2", 2, False, False),
    ("p2p", 0.1, "pp2", 2, False, False), ("broadcast", 0.1, "tp2", 4, True, False)])
def test_sharded_trainer_syncs_into_other_shardings_bit_exactly(ray_session, tiny_model_dir, tiny_qwen2_dir, tmp_path,
                                                                comm, bucket_mb, trainer, policy_tp, free, then_kill):
    """ZeRO 2, PP 2 or TP 2 trainer -> policy TP 2 x 2 replicas or TP 4 over one gloo group; buckets smaller
    (0.1 MiB) and larger (8 MiB) than the largest tensor (the 0.26 MiB embedding); the debug check compares
    digests too. With ``free_sync_collective_group`` two syncs each join and leave their own group. The PP 2
    case runs the tiny Qwen2: its tied embedding crosses once, and every receiver keeps it tied.

    ``then_kill``: after its sync, a receiver is killed and the next sync is an error naming the group, within
    the route's timeout (on the same six processes: a layout of its own would cost their start-up again)."""
    qwen2 = trainer == "pp2"
    workers, by_name, route = _sync_setup(tiny_qwen2_dir if qwen2 else tiny_model_dir, tmp_path, comm, bucket_mb,
                                          trainer, policy_tp, free)
    try:
        src, dst = workers.groups["ppo_policy"], workers.groups["policy"]
        assert [len(rep) for rep in dst.replicas] == [policy_tp] * (4 // policy_tp)
        for step in range(2 if free else 1):
            # weights now differ from the files (and from the last sync)
            done(src.heads[0].call.remote("train_step", micro_batches(seed=step), step))
            want = done(src.heads[0].get_weights.remote())
            before = done(dst.heads[-1].get_weights.remote())
            assert any(not torch.equal(before[k], want[k]) for k in want)
            stats = sync_routes([route], by_name.__getitem__)[route.key]
            sent = {id(t): t for t in want.values()}.values()  # a tied tensor once
            assert stats["bytes"] == sum(t.numel() * t.element_size() for t in sent)
            assert len(sent) == len(want) - qwen2
            for head in dst.heads:
                got = done(head.get_weights.remote())
                assert all(torch.equal(got[k], want[k]) for k in want)
                shards = ray.get(head.ranks[1].call.remote("sync_targets"))
                assert any(type(t).__name__ == "DTensor" for t in shards.values())  # still TP-sharded
            if qwen2:
                assert all(ray.get([by_name[p].__ray_call__.remote(lambda w: tied(w.slots["policy"].module))
                                    for rep in route.dst_ranks for p in rep]))
            if free:  # every member left the group after the sync
                assert not any(ray.get([by_name[p].__ray_call__.remote(lambda w: bool(w.sync_groups))
                                        for p in route.members]))
        if then_kill:
            ray.kill(by_name[route.members[-1]], no_restart=True)
            t0 = time.monotonic()
            with pytest.raises(SyncError, match=r"param sync ppo_policy->policy") as info:
                sync_routes([route], by_name.__getitem__)
            assert time.monotonic() - t0 < route.timeout_s + 35
            assert route.members[-1] in str(info.value) or "rank" in str(info.value)
    finally:
        workers.kill()


def test_the_debug_check_names_the_first_tensor_that_differs():
    from chatlearn.runtime.weights.sync import first_mismatch

    route = SyncRoute(key="t->p", src="t", dst="p", src_ranks=["w0"], dst_ranks=[["w1"], ["w2", "w3"]],
                      specs=[("a", [2], "float32"), ("b", [2], "float32")])
    sent = {"a": "1", "b": "2"}
    results = {"w0": {"trainer_digests": sent}, "w1": {"receiver_digests": sent}, "w2": {"receiver_digests": sent},
               "w3": {"receiver_digests": {"a": "1", "b": "x"}}}
    assert first_mismatch(route, results) == ("param sync t->p (debug check): p replica 1 rank 1 (process w3) has "
                                              "'b' different from t's after the sync")
    results["w3"] = {"receiver_digests": sent}
    assert first_mismatch(route, results) is None


def test_mismatched_models_are_refused_at_setup():
    route = SyncRoute(key="a->b", src="a", dst="b", src_ranks=["w0"], dst_ranks=[["w1"]])
    with pytest.raises(SyncError, match=r"'x' is \[2, 3\] float32 in a but \[3, 2\] float32 in b"):
        check_specs(route, [("x", [2, 3], "float32")], [("x", [3, 2], "float32")])
    with pytest.raises(SyncError, match="b has 'y', which a does not"):
        check_specs(route, [("x", [2], "float32")], [("y", [2], "float32")])


def _default_run(tmp_path, tiny_model_dir, name: str, extra: list[str]) -> list[dict]:
    from flows import train_flow

    overrides = [f"runtime.output_dir={tmp_path}", f"runtime.exp_name={name}", "runtime.num_episode=2",
                 "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false",
                 "runtime.save_episode_interval=2", "runtime.sample_per_episode=64",
                 "runtime.generation_batch_size=32", "runtime.train_micro_batch_size=16",
                 "runtime.train_global_batch_size=32"]
    for m in ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value"):
        overrides.append(f"models.{m}.cpu_per_process=1")
        if m != "reward":  # a rule reward has no model (its args_dict is strict)
            overrides.append(f"models.{m}.args_dict.model_path={tiny_model_dir}")
    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "default.yaml"),
                      overrides + extra)
    train_flow(cfg)
    rows = [__import__("json").loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [1, 2]
    return rows


@pytest.mark.integration
def test_default_with_zero2_trainers_and_tp2_policy_follows_the_single_process_run(
        prefect_api, ray_session, tiny_model_dir, tmp_path):
    """Two episodes of the embedded default: trainers ZeRO 2 (FSDP2), policy TP 2, all colocated in a 2-process
    world (sync is an in-process copy of each rank's slice), sharded checkpoints at the end; against the same
    run with the models in single processes (inference models then have 2 replicas)."""
    parallel = ["models.ppo_policy.zero_size=2", "models.ppo_value.zero_size=2",
                "models.policy.tensor_model_parallel_size=2"]
    want = _default_run(tmp_path, tiny_model_dir, "single", ["models.ppo_policy.num_cpu=1",
                                                             "models.ppo_value.num_cpu=1"])
    got = _default_run(tmp_path, tiny_model_dir, "sharded", parallel)
    for key in ("reward_mean", "policy_loss", "value_loss", "response_length_mean"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-4, abs=1e-6), key
    ckpt = tmp_path / "sharded" / "checkpoints" / "ppo_policy"
    assert any((p / ".metadata").is_file() for p in ckpt.iterdir())  # written sharded
    ranks = __import__("json").loads((tmp_path / "sharded" / "placement.json").read_text())["ranks"]
    assert [len(rep) for rep in ranks["policy"]] == [2] and [len(rep) for rep in ranks["ppo_policy"]] == [2]
    single = __import__("json").loads((tmp_path / "single" / "placement.json").read_text())["ranks"]
    assert [len(rep) for rep in single["policy"]] == [1, 1] and [len(rep) for rep in single["ppo_policy"]] == [1]
    # the export of the sharded trainer is a whole Hugging Face model, as the single-process one
    from transformers import AutoModelForCausalLM

    whole, plain = (AutoModelForCausalLM.from_pretrained(tmp_path / n / "final" / "policy").state_dict()
                    for n in ("sharded", "single"))
    assert {k: v.shape for k, v in whole.items()} == {k: v.shape for k, v in plain.items()}
    assert max(float((whole[k] - plain[k]).abs().max()) for k in plain) < 1e-3


def test_routes_run_in_waves_of_param_sync_max_workers(monkeypatch):
    """concurrent_comm with param_sync_max_workers: at most that many routes in flight; none is a no-op."""
    import chatlearn.runtime.weights.sync as sync

    events = []
    routes = [SyncRoute(key=f"t{i}->p{i}", src=f"t{i}", dst=f"p{i}", src_ranks=["w"], dst_ranks=[["v"]])
              for i in range(5)]
    monkeypatch.setattr(sync, "start", lambda r, actor: events.append(("start", r.key)) or {"route": r})
    monkeypatch.setattr(sync, "finish", lambda p, actor: events.append(("finish", p["route"].key)) or {})
    assert sync_routes([], None) == {}
    sync_routes(routes, None, concurrent=True, max_workers=2)
    assert [e[0] for e in events] == ["start", "start", "finish", "finish"] * 2 + ["start", "finish"]
    events.clear()
    sync_routes(routes, None, concurrent=False)
    assert [e[0] for e in events] == ["start", "finish"] * 5
    events.clear()
    sync_routes(routes, None, concurrent=True, max_workers=-1)
    assert [e[0] for e in events] == ["start"] * 5 + ["finish"] * 5


@pytest.mark.integration
def test_pipeline_stages_generate_and_score_as_one_process(ray_session, tiny_model_dir, tmp_path):
    """Policy in 2 pipeline stages: the same sampled responses (per-sample sampler) and log-probs as one
    process; greedy eval too."""
    import json

    cfg = load_config({"models": {"policy": {"num_cpu": 2, "cpu_per_process": 1, "pipeline_model_parallel_size": 2,
                                             "args_dict": {"model_path": tiny_model_dir, "max_new_tokens": 6}}},
                       "runtime": {"sample_per_episode": 8, "output_dir": str(tmp_path)}}, checks=[])
    records = [json.loads(line) for line in open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                                             "data", "max_digit_eval.jsonl"))][:6]
    one = PolicyInference("policy")
    one_cfg = cfg.models["policy"].model_copy(update={"pipeline_model_parallel_size": 1, "num_cpu": 1})
    one.bind(one_cfg, cfg.runtime, 0, cfg.runtime.seed)
    one.setup()
    batch = one.collate_fn(records)
    batch["sample_id"] = list(range(len(records)))
    want, want_eval = one.forward_step(dict(batch), 3), one.eval_step(dict(batch))
    workers = start(cfg, {"policy": PolicyInference("policy")})
    try:
        head = workers.groups["policy"].heads[0]
        assert len(head.ranks) == 2
        got = done(head.call.remote("forward_step", dict(batch), 3))
        got_eval = done(head.call.remote("eval_step", dict(batch)))
    finally:
        workers.kill()
    assert torch.equal(got["response_ids"], want["response_ids"]) and got["response"] == want["response"]
    torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-5, rtol=0)
    assert torch.equal(got_eval["response_ids"], want_eval["response_ids"])


@pytest.mark.integration
def test_a_dead_data_parallel_peer_is_an_error_naming_the_replica(ray_session, tiny_model_dir, tmp_path):
    """DP 2 trainer, rank 1's process killed: rank 0's step fails (not hangs), naming model, replica and rank."""
    cfg = config({"ppo_policy": {"trainable": True, "cpu_per_process": 1, "num_cpu": 2,
                                 "args_dict": model_args(tiny_model_dir)}}, str(tmp_path))
    workers = start(cfg, {"ppo_policy": GradProbe("ppo_policy")})
    try:
        ranks = workers.groups["ppo_policy"].replicas[0]
        ray.kill(ranks[1].actor, no_restart=True)
        with pytest.raises(ray.exceptions.RayTaskError, match=r"ppo_policy replica 0 rank 0 of 2 .*a collective of "
                                                              r"call failed: a peer process died"):
            ray.get(ranks[0].call.remote("train_step", micro_batches(), 0), timeout=400)
    finally:
        workers.kill()


class DPOGradProbe(__import__("chatlearn.models.hf.dpo", fromlist=["DPOPolicyTrainer"]).DPOPolicyTrainer):
    grads = GradProbe.grads


def pair_batches(n: int = 3) -> list[dict]:
    out = []
    for i, mb in enumerate(micro_batches(n, seed=1)):
        g = torch.Generator().manual_seed(100 + i)
        rej_mask = torch.ones(2, 4)
        rej_mask[1, 3] = 0
        out.append({"prompt_ids": mb["prompt_ids"], "prompt_mask": mb["prompt_mask"],
                    "response_ids": mb["response_ids"], "response_mask": mb["response_mask"],
                    "rejected_ids": torch.randint(4, 30, (2, 4), generator=g), "rejected_mask": rej_mask,
                    "ref_logprobs": mb["logprobs"], "rejected_ref_logprobs": -torch.rand(2, 4, generator=g) * rej_mask})
    return out


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["dp2", "zero2"])
def test_dpo_trainer_layouts_give_one_process_gradients(ray_session, tiny_model_dir, tmp_path, layout):
    """The DPO trainer runs two forward passes per micro-batch (chosen, rejected) before one backward; with DDP
    and FSDP2 over an odd number of micro-batches (one rank runs a zero-weight stand-in)."""
    args = {"model_path": tiny_model_dir, "lr": 1e-3, "max_grad_norm": 1e6}
    shape = {"trainable": True, "cpu_per_process": 1, "args_dict": args, **LAYOUTS[layout]}
    data = pair_batches()
    single = config({"ppo_policy": {**shape, "num_cpu": 1, "zero_size": 1}}, str(tmp_path))
    want_stats, want, stats, got = one_and_replica(DPOGradProbe, single, config({"ppo_policy": shape}, str(tmp_path)),
                                                   data)
    for key in ("dpo_loss", "reward_accuracy", "policy_grad_norm"):
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert worst <= 1e-6 * max(1.0, max(float(want[n].abs().max()) for n in want)), worst


def one_and_replica(cls, single, replica, data: list[dict]) -> tuple[dict, dict, dict, dict]:
    """One train step of ``cls`` as ``ppo_policy`` in this process (config ``single``) and on a replica (config
    ``replica``): (its statistics, its gradients) here, then the replica's."""
    one = cls("ppo_policy")
    one.bind(single.models["ppo_policy"], single.runtime, 0, single.runtime.seed)
    one.setup()
    want_stats = one.train_step([dict(mb) for mb in data], 0)
    want = one.grads()
    workers = start(replica, {"ppo_policy": cls("ppo_policy")})
    try:
        head = workers.groups["ppo_policy"].heads[0]
        return want_stats, want, done(head.call.remote("train_step", data, 0)), done(head.call.remote("grads"))
    finally:
        workers.kill()


class ValueGradProbe(__import__("chatlearn.models.hf.ppo_trainer", fromlist=["PPOValueTrainer"]).PPOValueTrainer):
    grads = GradProbe.grads


def value_batches() -> list[dict]:
    out = []
    for mb in micro_batches(seed=2):
        g = torch.Generator().manual_seed(7)
        mask = mb["response_mask"]
        out.append({**mb, "values": torch.randn(mask.shape, generator=g) * mask,
                    "returns": torch.randn(mask.shape, generator=g) * mask})
    return out


@pytest.mark.integration
@pytest.mark.parametrize(("layout", "probe"), [("dp2", "ppo"), ("zero2", "ppo"), ("tp2", "ppo"), ("pp2", "ppo"),
                                               ("dp2", "dpo"), ("zero2", "value")])
def test_packed_layouts_give_the_padded_one_process_gradients(ray_session, tiny_model_dir, tiny_qwen2_dir, tmp_path,
                                                              layout, probe):
    """Packing (issue 25 item 3) under DDP, FSDP2, TP and PP: the replica re-cuts the global batch by a 24-token
    budget (three micro-batches: one data rank runs a stand-in; the pipeline fills the rows to one width), packs
    each into one row, and its step's loss and gradients are the padded single process's (DPO: chosen and
    rejected in one forward under DDP; the value network's backbone packed under FSDP2)."""
    path = tiny_qwen2_dir if layout in ON_QWEN2 else tiny_model_dir
    cls, data = {"ppo": (GradProbe, micro_batches()), "dpo": (DPOGradProbe, pair_batches()),
                 "value": (ValueGradProbe, value_batches())}[probe]
    args = model_args(path) if probe == "ppo" else {"model_path": path, "lr": 1e-3, "max_grad_norm": 1e6}
    shape = {"trainable": True, "cpu_per_process": 1, "args_dict": args, **LAYOUTS[layout]}
    single = config({"ppo_policy": {**shape, "num_cpu": 1, "zero_size": 1, "tensor_model_parallel_size": 1,
                                    "pipeline_model_parallel_size": 1}}, str(tmp_path))
    packed = config({"ppo_policy": {**shape, "packing": True, "max_token_in_packing": 24}}, str(tmp_path))
    want_stats, want, stats, got = one_and_replica(cls, single, packed, data)
    keys = {"ppo": ("policy_loss", "clipfrac", "approx_kl", "policy_grad_norm"),
            "dpo": ("dpo_loss", "reward_accuracy", "policy_grad_norm"),
            "value": ("value_loss", "vf_clipfrac", "value_grad_norm")}[probe]
    for key in keys:
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key
    assert got.keys() == want.keys()
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    scale = max(float(want[n].abs().max()) for n in want)
    assert worst <= 1e-5 * scale, f"{layout} {probe}: packed gradients differ by {worst} (largest {scale})"


@pytest.mark.integration
def test_pipeline_stages_score_packed_as_one_padded_process(ray_session, tiny_qwen2_dir, tmp_path):
    """The reference in 2 pipeline stages with packing scores in rows of at most 20 tokens (the stages pass a
    packed row's activations on) the log-probs one padded process gives."""
    from chatlearn.data.batch import collate_samples, split_batch
    from chatlearn.models.hf.reference import ReferenceModel

    batch = collate_samples([s for mb in micro_batches() for s in split_batch(mb)])
    shape = {"num_cpu": 2, "cpu_per_process": 1, "pipeline_model_parallel_size": 2, "packing": True,
             "max_token_in_packing": 20, "args_dict": {"model_path": tiny_qwen2_dir}}
    cfg = config({"reference": shape}, str(tmp_path))
    one = ReferenceModel("reference")
    one.bind(cfg.models["reference"].model_copy(update={"pipeline_model_parallel_size": 1, "num_cpu": 1,
                                                        "packing": False}), cfg.runtime, 0, cfg.runtime.seed)
    one.setup()
    want = one.forward_step(dict(batch), 0)["ref_logprobs"]
    workers = start(cfg, {"reference": ReferenceModel("reference")})
    try:
        got = done(workers.groups["reference"].heads[0].call.remote("forward_step", dict(batch), 0))["ref_logprobs"]
    finally:
        workers.kill()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_run_says_how_each_multi_process_model_splits(capsys):
    from flows.train_flow import _show_layouts

    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "default.yaml"),
                      ["models.ppo_policy.cpu_per_process=1", "models.ppo_policy.zero_size=2",
                       "models.ppo_value.cpu_per_process=1", "models.policy.cpu_per_process=1",
                       "models.policy.tensor_model_parallel_size=2"])
    _show_layouts(cfg)
    assert capsys.readouterr().err == "parallel layouts: policy TP 2, ppo_policy ZeRO 2, ppo_value DP 2\n"
