"""Actors get the Ray resources their ModelConfig asks for (real Ray, fake GPUs)."""

import pytest
import ray

from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.model_group import create_model_group, replica_layout, required_cpus
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig

pytestmark = pytest.mark.integration


def test_replica_layout_arithmetic():
    assert replica_layout(ModelConfig(num_cpu=3)) == (3, 1, {"num_cpus": 1.0, "num_gpus": 0.0})
    assert replica_layout(ModelConfig(num_cpu=4, cpu_per_process=2)) == (2, 1, {"num_cpus": 2.0, "num_gpus": 0.0})
    assert replica_layout(ModelConfig(num_cpu=2, cpu_per_process=2, trainable=True))[:2] == (1, 1)
    assert replica_layout(ModelConfig(num_gpu=4, gpu_per_process=1)) == (4, 1, {"num_gpus": 1.0, "num_cpus": 0.0})
    assert replica_layout(ModelConfig(num_gpu=4, tensor_model_parallel_size=2))[:2] == (2, 2)
    assert replica_layout(ModelConfig(num_device=2, trainable=True))[:2] == (1, 2)
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
    group = create_model_group("probe", BaseModule("probe"), cfg, RuntimeConfig(), seed=1)
    try:
        infos = ray.get([a.setup.remote() for a in group.actors])
        assert group.num_replica == expected_replicas
        assert [i["resources"] for i in infos] == [expected_resources] * expected_replicas
        if "GPU" in expected_resources:
            assert all(len(i["gpu_ids"]) == 1 for i in infos)
            assert len({tuple(i["gpu_ids"]) for i in infos}) == expected_replicas  # distinct GPUs
    finally:
        group.kill()
