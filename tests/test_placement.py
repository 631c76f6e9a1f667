"""ChatLearn's placement rules, on layouts worked out by hand (no Ray: the plan is plain arithmetic)."""

import pytest

from chatlearn.config import load_config
from chatlearn.runtime.cluster.placement import (
    NodeSpec,
    PlacementError,
    find_packs,
    plan_placement,
    uniform_cluster,
)


def _cfg(models: dict, **runtime):
    return load_config({"models": models, "runtime": {"sample_per_episode": 64, **runtime}}, checks=[])


def _ranks(plan, name):
    """(node, device, share, process) of every rank, replica by replica."""
    return [[(r.node, r.device, r.share, r.process) for r in rep] for rep in plan.models[name]]


def test_packs_follow_chatlearn():
    assert find_packs([("A", False, 8), ("B", False, 4), ("C", False, 4)], 8) == [["A"], ["B", "C"]]
    # sorted trainable first, then by size; a pack with room takes the next model that fits
    assert find_packs([("B", False, 2), ("T", True, 4), ("C", False, 2), ("D", False, 4)], 4) == [
        ["T"], ["D"], ["B", "C"]]
    assert find_packs([("A", False, 8), ("B", False, 4), ("C", False, 2), ("D", False, 2)], 8) == [
        ["A"], ["B", "C", "D"]]
    # ChatLearn 1.0.2 raises IndexError here (a refilled pack leaves an empty list under its old free size)
    assert find_packs([("A", False, 8), ("B", False, 2), ("C", False, 2), ("D", False, 6), ("E", False, 2)], 8) == [
        ["A"], ["D", "B"], ["C", "E"]]


def test_colocated_group_shares_devices_and_processes():
    cfg = _cfg({"policy": {"num_gpu": 4}, "reference": {"num_gpu": 2}, "reward": {"num_gpu": 2},
                "ppo_policy": {"num_gpu": 4, "trainable": True}},
               colocation=["policy,reference,reward"])
    plan = plan_placement(cfg, ["policy", "reference", "reward", "ppo_policy"], uniform_cluster(1, 8))
    assert plan.units[0].packs == [["policy"], ["reference", "reward"]]
    # device d hosts policy replica d and, halved, reference (devices 0-1) or reward (devices 2-3)
    assert _ranks(plan, "policy") == [[(0, d, 0.5, d)] for d in range(4)]
    assert _ranks(plan, "reference") == [[(0, 0, 0.5, 0)], [(0, 1, 0.5, 1)]]
    assert _ranks(plan, "reward") == [[(0, 2, 0.5, 2)], [(0, 3, 0.5, 3)]]
    # the trainer is one replica of four ranks on the next four devices, alone on each
    assert _ranks(plan, "ppo_policy") == [[(0, 4 + k, 1.0, 4 + k) for k in range(4)]]
    assert plan.processes[0].members == [("policy", 0, 0), ("reference", 0, 0)]
    assert plan.rows()[0] == {"process": 0, "node": 0, "devices": "0", "cpus": 0.0,
                              "models": "policy replica 0, reference replica 0"}
    assert plan.rows()[4]["models"] == "ppo_policy replica 0 rank 0"
    assert (plan.devices_required, plan.devices_available, plan.warnings) == (8, 8, [])
    assert plan.colocated["policy"] == ["reference", "reward"] and plan.colocated["ppo_policy"] == []
    out = plan.to_json()
    assert out["models"]["reference"] == {"num_replica": 2, "replicas": [
        [{"node": 0, "device": 0, "share": 0.5, "process": 0}], [{"node": 0, "device": 1, "share": 0.5, "process": 1}]]}


def test_units_fill_nodes_and_span_whole_nodes():
    cfg = _cfg({"policy": {"num_gpu": 2}, "ppo_policy": {"num_gpu": 8, "trainable": True}})
    plan = plan_placement(cfg, ["policy", "ppo_policy"], uniform_cluster(3, 4))
    assert _ranks(plan, "policy") == [[(0, 0, 1.0, 0)], [(0, 1, 1.0, 1)]]
    # 8 GPUs > 4 per node: whole free nodes (1 and 2), node 0 is partly used
    assert [(r.node, r.device) for r in plan.models["ppo_policy"][0]] == [(1, d) for d in range(4)] + [
        (2, d) for d in range(4)]
    assert plan.devices_required == 10 and "2 of 12 GPUs are not used" in plan.warnings[0]


def test_tensor_parallel_replicas_and_gpu_per_process():
    cfg = _cfg({"policy": {"num_gpu": 4, "tensor_model_parallel_size": 2},
                "reward": {"num_gpu": 4, "gpu_per_process": 2, "tensor_model_parallel_size": 2}})
    plan = plan_placement(cfg, ["policy", "reward"], uniform_cluster(1, 8))
    assert _ranks(plan, "policy") == [[(0, 0, 1.0, 0), (0, 1, 1.0, 1)], [(0, 2, 1.0, 2), (0, 3, 1.0, 3)]]
    # a process of two GPUs: one rank per replica, its devices listed
    assert [[r.devices for r in rep] for rep in plan.models["reward"]] == [[(4, 5)], [(6, 7)]]
    assert plan.to_json()["models"]["reward"]["replicas"][0][0]["devices"] == [4, 5]


def test_cpu_processes_play_devices():
    cfg = _cfg({"policy": {"num_cpu": 4, "cpu_per_process": 1, "tensor_model_parallel_size": 2}})
    assert cfg.models["policy"].num_replica == 2
    plan = plan_placement(cfg, ["policy"], uniform_cluster(1, 0, 8))
    assert _ranks(plan, "policy") == [[(0, None, 0.0, 0), (0, None, 0.0, 1)], [(0, None, 0.0, 2), (0, None, 0.0, 3)]]
    assert plan.cpus_required == 4 and plan.devices_required == 0


@pytest.mark.parametrize(("strategy", "nodes"), [("SPREAD", [0, 1, 0, 1]), ("PACK", [0, 0, 0, 0])])
def test_cpu_schedule_strategy(strategy, nodes):
    cfg = _cfg({"reward": {"num_cpu": 4}}, cpu_schedule_strategy=strategy)
    plan = plan_placement(cfg, ["reward"], uniform_cluster(2, 0, 4))
    assert [rep[0].node for rep in plan.models["reward"]] == nodes


def test_colocated_cpu_models_share_one_process():
    names = ["policy", "reference", "reward", "value", "ppo_policy", "ppo_value"]
    cfg = _cfg({n: {"num_cpu": 1, "trainable": n.startswith("ppo")} for n in names}, colocation=[",".join(names)])
    plan = plan_placement(cfg, names, [NodeSpec(0, 2)])
    assert len(plan.processes) == 1 and plan.processes[0].models == ["ppo_policy", "ppo_value", "policy",
                                                                    "reference", "reward", "value"]
    assert {plan.models[n][0][0].process for n in names} == {0}
    assert plan.cpus_required == 1


def test_too_small_a_cluster_lists_required_and_available():
    cfg = _cfg({"policy": {"num_gpu": 4}, "reference": {"num_gpu": 2}, "ppo_policy": {"num_gpu": 2, "trainable": True},
                "reward": {"num_cpu": 3, "cpu_per_process": 2}}, colocation=["policy,reference"])
    with pytest.raises(PlacementError) as err:
        plan_placement(cfg, ["policy", "reference", "ppo_policy", "reward"], uniform_cluster(1, 4, 1))
    msg = str(err.value)
    assert "GPUs: 6 required, 4 available (1 node(s): 4 GPUs)" in msg
    assert "colocation group 'policy,reference' 4 (policy 4, reference 2); ppo_policy 2" in msg
    assert "CPUs: 2 required, 1 available" in msg and "reward 2" in msg


def test_colocation_needs_one_kind_and_one_gpu_per_process():
    cfg = _cfg({"policy": {"num_gpu": 2, "gpu_per_process": 2}, "reward": {"num_cpu": 1}},
               colocation=["policy,reward"])
    with pytest.raises(PlacementError) as err:
        plan_placement(cfg, ["policy", "reward"], uniform_cluster(1, 2))
    assert "mixes GPU models (policy) and CPU-only models (reward)" in str(err.value)
    assert "models.policy.gpu_per_process: colocated GPU models need gpu_per_process=1" in str(err.value)


def test_fragmented_cluster_is_refused():
    cfg = _cfg({"policy": {"num_gpu": 3}, "reward": {"num_gpu": 3}, "value": {"num_gpu": 2}})
    with pytest.raises(PlacementError, match=r"'value' needs 2 GPUs on one node.*free GPUs per node: \[1, 1\]"):
        plan_placement(cfg, ["policy", "reward", "value"], uniform_cluster(2, 4))
