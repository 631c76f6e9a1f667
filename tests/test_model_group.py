"""A placement plan realised on a real Ray: resources, devices, shared processes and torch.distributed groups."""

import pytest
import ray
import torch
import torch.distributed as dist

from chatlearn.config import ModelConfig, load_config
from chatlearn.config.model import ReplicaLayout
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.cluster.model_group import cluster_nodes, setup_models, start_workers
from chatlearn.runtime.cluster.placement import plan_placement

pytestmark = pytest.mark.integration


def test_replica_layout_arithmetic():
    assert ModelConfig(num_cpu=3).layout == ReplicaLayout(replicas=3, processes=1, gpus=0.0, cpus=1.0)
    assert ModelConfig(num_cpu=4, cpu_per_process=2).layout == ReplicaLayout(2, 1, 0.0, 2.0)
    assert ModelConfig(num_cpu=2, cpu_per_process=2, trainable=True).layout[:2] == (1, 1)
    assert ModelConfig(num_cpu=4, tensor_model_parallel_size=2).layout[:2] == (2, 2)
    assert ModelConfig(num_gpu=4, gpu_per_process=1).layout == ReplicaLayout(4, 1, 1.0, 0.0)
    assert ModelConfig(num_gpu=4, tensor_model_parallel_size=2).layout[:2] == (2, 2)
    assert ModelConfig(num_device=2, trainable=True).layout[:2] == (1, 2)


class Probe(BaseModule):
    """Reports where it runs and sums a tensor over its replica's process group."""

    multi_process = True

    def all_reduce(self, value: float) -> list[float]:
        t = torch.tensor([value, float(self.rank)])
        if self.process_group is not None:
            dist.all_reduce(t, group=self.process_group)
        return t.tolist()


# workers cannot import this test file: ship Probe by value, as cloudpickle does for a script's classes
ray.cloudpickle.register_pickle_by_value(__import__(__name__))


def _start(models: dict, **runtime):
    cfg = load_config({"models": models, "runtime": {"sample_per_episode": 64, **runtime}}, checks=[])
    names = list(models)
    nodes, ids = cluster_nodes()
    plan = plan_placement(cfg, names, nodes)
    workers = start_workers(plan, ids, cfg, {n: Probe(n) for n in names})
    return plan, workers, setup_models(workers, cfg.runtime.concurrent_setup, 600)


@pytest.mark.parametrize(
    ("model", "replicas", "resources"),
    [
        ({"num_cpu": 2}, 2, {"CPU": 1.0}),
        ({"num_cpu": 2, "cpu_per_process": 2}, 1, {"CPU": 2.0}),
        ({"num_gpu": 2, "gpu_per_process": 1}, 2, {"GPU": 1.0}),
        ({"num_gpu": 1, "trainable": True}, 1, {"GPU": 1.0}),
    ],
)
def test_workers_get_the_resources_of_their_plan(ray_session, model, replicas, resources):
    plan, workers, infos = _start({"probe": model})
    try:
        assert workers.groups["probe"].num_replica == replicas
        assert [i["resources"] for i in infos["probe"]] == [resources] * replicas
        if "GPU" in resources:  # fake GPUs: the ids Ray gave are the devices the plan chose
            assert [[int(g) for g in i["gpu_ids"]] for i in infos["probe"]] == [[d] for d in range(replicas)]
    finally:
        workers.kill()


def test_a_four_process_replica_all_reduces(ray_session):
    """num_cpu 8, TP 4: two replicas of four processes, one world of eight, a group per replica."""
    plan, workers, infos = _start({"probe": {"num_cpu": 8, "tensor_model_parallel_size": 4}})
    try:
        group = workers.groups["probe"]
        assert [len(rep) for rep in group.replicas] == [4, 4]
        sums = ray.get([h.call.remote("all_reduce", 10.0 * (r + 1)) for r, rep in enumerate(group.replicas)
                        for h in rep])
        # replica 0 adds 10 four times, replica 1 adds 20; ranks 0..3 add to 6 in both
        assert sums == [[40.0, 6.0]] * 4 + [[80.0, 6.0]] * 4
        assert len({i["pid"] for i in infos["probe"]}) == 8
    finally:
        workers.kill()


def test_colocated_models_share_a_process_and_split_the_device(ray_session):
    plan, workers, infos = _start({"policy": {"num_gpu": 2}, "reference": {"num_gpu": 1}, "reward": {"num_gpu": 1}},
                                  colocation=["policy,reference,reward"])
    try:
        # device 0: policy replica 0 + reference; device 1: policy replica 1 + reward; one process each
        assert [i["pid"] for i in infos["policy"]] == [infos["reference"][0]["pid"], infos["reward"][0]["pid"]]
        assert [[int(g) for g in i["gpu_ids"]] for i in infos["policy"]] == [[0], [1]]
        assert [r[0].share for r in plan.models["policy"]] == [0.5, 0.5]
        assert infos["policy"][0]["resources"] == {"GPU": 1.0}  # the process holds the whole device
        assert workers.groups["reference"].heads[0].process == workers.groups["policy"].heads[0].process
    finally:
        workers.kill()
