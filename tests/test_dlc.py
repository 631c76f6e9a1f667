"""`runtime_env.platform: DLC`: the job's variables give each node its role; a mock DLC job of two nodes on
this machine (ChatLearn's LOCAL_MASTER_ADDR) trains with the head on rank 0 and the trainers on rank 1."""

import json
import os
import socket
import subprocess
import sys
import warnings

import pytest

from chatlearn.config import ConfigWarning
from chatlearn.runtime.cluster.dlc import DLCNode, dlc_node
from tests.conftest import REPO


def test_roles_come_from_the_jobs_variables():
    env = {"JOB_NAME": "job", "RANK": "2", "CUSTOM_PORTS": "8265;10005;30001;30002"}
    # Ray's own ports are skipped, as ChatLearn does
    assert dlc_node("DLC", env) == DLCNode(2, "job-master-0", "job-worker-1", 30001, 30002)
    assert dlc_node("dlc", dict(env, RANK="0")) == DLCNode(0, "job-master-0", "job-master-0", 30001, 30002)
    assert dlc_node("", env) is None
    local = {"LOCAL_MASTER_ADDR": "127.0.0.1", "RANK": "1", "CUSTOM_PORTS": "30001;30003"}
    assert dlc_node("DLC", local) == DLCNode(1, "127.0.0.1", "127.0.0.1", 30001, 30003)
    assert dlc_node("DLC", dict(local, WORLD_SIZE="4")).nodes == 4


def test_missing_variables_warn_and_stay_local_bad_ones_fail():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dlc_node("DLC", {"RANK": "0"}) is None
    assert [str(w.message) for w in caught if w.category is ConfigWarning] == [
        "runtime_env.platform: DLC, but CUSTOM_PORTS, JOB_NAME not set (is the job submitted to DLC with "
        "customPortList / createSvcForAllWorkers?); running on this machine alone"]
    with pytest.raises(ValueError, match="needs two ports Ray does not reserve"):
        dlc_node("DLC", {"JOB_NAME": "j", "RANK": "0", "CUSTOM_PORTS": "8265;12000;30001"})


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.integration
def test_a_mock_dlc_job_of_two_nodes_trains(prefect_api, tiny_model_dir, tmp_path):
    from prefect.settings import PREFECT_API_URL

    gcs, nm0, nm1 = _free_ports(3)
    args = [sys.executable, "-m", "chatlearn.cli", "train", "runtime_env.platform=DLC",
            "runtime.num_episode=1", "runtime.sample_per_episode=32", "runtime.generation_batch_size=16",
            "runtime.train_micro_batch_size=16", "runtime.train_global_batch_size=32",
            "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false",
            "runtime.colocation=['policy,reference,reward,value', 'ppo_policy,ppo_value']",
            *[f"models.{m}.num_gpu=1" for m in ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")],
            f"runtime.output_dir={tmp_path}", "runtime.exp_name=dlc"]
    base = dict(os.environ, LOCAL_MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", CHATLEARN_FAKE_GPUS="1",
                CHATLEARN_TINY_MODEL_DIR=tiny_model_dir, PREFECT_API_URL=PREFECT_API_URL.value())
    base.pop("RAY_ADDRESS", None)
    worker = subprocess.Popen(args, cwd=REPO, env=dict(base, RANK="1", CUSTOM_PORTS=f"{gcs};{nm1}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        head = subprocess.run(args, cwd=REPO, env=dict(base, RANK="0", CUSTOM_PORTS=f"{gcs};{nm0}"),
                              capture_output=True, text=True, timeout=600)
        assert head.returncode == 0, head.stderr[-4000:]
        _, worker_err = worker.communicate(timeout=120)  # it exits once the head is gone
    finally:
        if worker.poll() is None:
            worker.terminate()  # it stops its Ray node on the way out
            worker.wait(timeout=60)
    assert worker.returncode == 0, worker_err[-3000:]
    assert "joined the Ray head" in worker_err and "the head is gone, exiting" in worker_err
    placement = json.loads((tmp_path / "dlc" / "placement.json").read_text())
    head_node, second = placement["nodes"]
    on = {name: {r["node_id"] for rep in reps for r in rep} for name, reps in placement["ranks"].items()}
    assert on["policy"] == on["reward"] == {head_node} and on["ppo_policy"] == on["ppo_value"] == {second}
    rows = (tmp_path / "dlc" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and 0.0 <= json.loads(rows[0])["reward_mean"] <= 1.0
