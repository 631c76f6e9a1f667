"""Actors get the Ray resources their ModelConfig asks for (real Ray, fake GPUs)."""

import pytest
import ray

from chatlearn.config import ModelConfig, RuntimeConfig
from chatlearn.config.model import ReplicaLayout
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.model_group import create_model_group, required_cpus

pytestmark = pytest.mark.integration


def test_replica_layout_arithmetic():
    assert ModelConfig(num_cpu=3).layout == ReplicaLayout(replicas=3, processes=1, gpus=0.0, cpus=1.0)
    assert ModelConfig(num_cpu=4, cpu_per_process=2).layout == ReplicaLayout(2, 1, 0.0, 2.0)
    assert ModelConfig(num_cpu=2, cpu_per_process=2, trainable=True).layout[:2] == (1, 1)
    assert ModelConfig(num_gpu=4, gpu_per_process=1).layout == ReplicaLayout(4, 1, 1.0, 0.0)
    assert ModelConfig(num_gpu=4, tensor_model_parallel_size=2).layout[:2] == (2, 2)
    assert ModelConfig(num_device=2, trainable=True).layout[:2] == (1, 2)
    assert required_cpus({"a": ModelConfig(num_cpu=3), "b": ModelConfig(num_gpu=1)}) == 3.0


@pytest.mark.parametrize(
    ("cfg", "expected_replicas", "expected_resources"),
    [
        (ModelConfig(num_cpu=2), 2, {"CPU": 1.0}),
        (ModelConfig(num_cpu=2, cpu_per_process=2), 1, {"CPU": 2.0}),
        (ModelConfig(num_gpu=2, gpu_per_process=1), 2, {"GPU": 1.0}),
        (ModelConfig(num_gpu=1, trainable=True), 1, {"GPU": 1.0}),
    ],
)
def test_actors_get_the_resources_of_their_config(ray_session, cfg, expected_replicas, expected_resources):
    group = create_model_group("probe", BaseModule("probe"), cfg, RuntimeConfig(seed=1))
    try:
        infos = ray.get([a.setup.remote() for a in group.actors])
        assert group.num_replica == expected_replicas
        assert [i["resources"] for i in infos] == [expected_resources] * expected_replicas
        if "GPU" in expected_resources:
            assert all(len(i["gpu_ids"]) == 1 for i in infos)
            assert len({tuple(i["gpu_ids"]) for i in infos}) == expected_replicas  # distinct GPUs
    finally:
        group.kill()
