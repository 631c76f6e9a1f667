"""Whole `chatlearn train` runs on real placements: fake GPUs on one node, a real 2-node Ray cluster, and
colocated models handing memory over with every offload flag on.

* One node declares 4 GPUs (``CHATLEARN_FAKE_GPUS=4``, the math stays on the CPU): the inference models are
  colocated on 3 of them, the two trainers share the 4th, and the CPU-only reward runs two replicas. Every rank
  must run on the device ids the plan gave. The reward function comes from a package that only
  ``runtime_env.py_modules`` ships to the workers.
* The same config on two raylets of one machine (3 + 1 GPUs, joined through ``RAY_ADDRESS``): the colocation
  group lands on node 0, the trainers on node 1, SPREAD puts one reward replica on each node, and the rows and
  the final policy equal the one-node run's.
* The one-node run hands memory over (``free_memory`` on every colocated model, 1 MiB staging buckets) and the
  two-node run does not: equal rows and weights prove the offload bit-identical as well (one pair of runs for
  both points), and the one-node run reports the memory handed over every episode.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO

pytestmark = pytest.mark.integration

SMALL = ["runtime.num_episode=2", "runtime.sample_per_episode=48", "runtime.generation_batch_size=16",
         "runtime.train_micro_batch_size=16", "runtime.train_global_batch_size=48", "runtime.eval_episode_interval=0",
         "runtime.enable_eval_before_training=false"]
GPU_LAYOUT = ["runtime.colocation=['policy,reference,value', 'ppo_policy,ppo_value']", "runtime.concurrent_setup=false",
              "models.policy.num_gpu=3", "models.value.num_gpu=2", "models.reference.num_gpu=1",
              "models.ppo_policy.num_gpu=1", "models.ppo_value.num_gpu=1",
              "models.reward.num_cpu=2", "models.reward.cpu_per_process=1", "runtime.cpu_schedule_strategy=SPREAD"]
# memory handed over between the colocated models of each device, in the one-node run only
OFFLOAD = ["runtime.bucket_size_mb_in_memory_manager=1",
           *(f"models.{n}.free_memory=true" for n in ("policy", "reference", "value", "ppo_policy", "ppo_value"))]
TIMING = ("episode_seconds", "stage_seconds", "peak_memory_mb", "startup_seconds", "checkpoint_paths")


def train(out: Path, exp: str, tiny_model_dir: str, *args: str, env: dict | None = None):
    from prefect.settings import PREFECT_API_URL

    full_env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(out), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
                    PREFECT_API_URL=PREFECT_API_URL.value(), **(env or {}))
    if "RAY_ADDRESS" not in (env or {}):
        full_env.pop("RAY_ADDRESS", None)
    res = subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", *SMALL, *args, f"runtime.exp_name={exp}"],
                         cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return out / exp


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_policy(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "policy" / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def shipped_reward(tmp_path_factory) -> list[str]:
    """A reward package the driver's sys.path does not have: only py_modules brings it to the workers."""
    root = tmp_path_factory.mktemp("shipped")
    pkg = root / "shipped_reward"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from chatlearn.tasks.max_digit import max_digit_reward\n\n\n"
                                     "def reward(sample):\n"
                                     "    return max_digit_reward(sample)\n")
    assert str(root) not in sys.path
    return [f"runtime_env.py_modules=['{pkg}']", "models.reward.args_dict.reward_fn=shipped_reward:reward"]


@pytest.fixture(scope="module")
def one_node_run(prefect_api, tiny_model_dir, tmp_path_factory, shipped_reward) -> Path:
    return train(tmp_path_factory.mktemp("fake-gpus"), "fake4", tiny_model_dir, *GPU_LAYOUT, *shipped_reward,
                 *OFFLOAD, env={"CHATLEARN_FAKE_GPUS": "4"})


def test_fake_gpu_run_uses_the_planned_devices(one_node_run):
    placement = json.loads((one_node_run / "placement.json").read_text())
    plan, ranks = placement["plan"]["models"], placement["ranks"]
    for name in ("policy", "reference", "value", "ppo_policy", "ppo_value"):
        planned = [[r["device"]] for rep in plan[name]["replicas"] for r in rep]
        assert [r["gpu_ids"] for rep in ranks[name] for r in rep] == planned, name
    # device 0: policy r0 + value r0, device 1: policy r1 + value r1, device 2: policy r2 + reference,
    # device 3: both trainers; one process per device
    assert [rep[0]["device"] for rep in plan["policy"]["replicas"]] == [0, 1, 2]
    assert [rep[0]["device"] for rep in plan["value"]["replicas"]] == [0, 1]
    assert plan["reference"]["replicas"][0][0]["device"] == 2
    assert plan["ppo_policy"]["replicas"][0][0] == plan["ppo_value"]["replicas"][0][0] == {
        "node": 0, "device": 3, "share": 0.5, "process": 3}
    pids = {name: [r["pid"] for rep in ranks[name] for r in rep] for name in ranks}
    assert pids["policy"][:2] == pids["value"] and pids["policy"][2] == pids["reference"][0]
    assert pids["ppo_policy"] == pids["ppo_value"]
    assert plan["reward"]["num_replica"] == 2 and plan["reward"]["replicas"][0][0]["device"] is None
    got = rows(one_node_run)
    assert [r["episode"] for r in got] == [1, 2] and all(0.0 <= r["reward_mean"] <= 1.0 for r in got)
    # every episode moves the colocated models' weights (and the trainers' optimizer states and grads) out while
    # the others run; the two-node run (no offload) ending equal proves it exact (check_two_nodes)
    handed = [r["handover_mb"] for r in got]
    assert all(mb > 5 for mb in handed), handed


@pytest.fixture(scope="module")
def two_node_cluster():
    """A Ray cluster of two raylets on this machine (3 + 1 fake GPUs), joined through RAY_ADDRESS: (cluster, the
    second node). The tests below use it in order; the last one takes its head away."""
    from ray.cluster_utils import Cluster

    # the cluster's own processes wait 5 minutes for a lost GCS (Ray's default: 60 s), so when its head goes away
    # the run's model processes end because the run asked them to, not because their raylet gave up. No dashboard:
    # nothing here reads it, and its head process polls a lost GCS at most of a core (this module took 296 s with
    # it, 250 s without, side by side)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "300")
        cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=4, num_gpus=3, resources={"head": 1},
                                                                       include_dashboard=False))
        second = cluster.add_node(num_cpus=4, num_gpus=1, resources={"second": 1})
    try:
        cluster.wait_for_nodes()
        yield cluster, second
    finally:
        cluster.shutdown()


def test_one_two_node_cluster_matches_one_node_then_fails_in_one_line_when_a_node_is_lost_or_missing(
        two_node_cluster, one_node_run, prefect_api, tiny_model_dir, tmp_path, shipped_reward):
    """One two-node cluster for three runs, in order: the run matches the one-node run; a run that loses the
    second node mid-run fails naming it; on the head alone the layout does not fit: one line, nothing written."""
    cluster, second = two_node_cluster
    run_dir = train(tmp_path, "two-nodes", tiny_model_dir, *GPU_LAYOUT, *shipped_reward,
                    env={"RAY_ADDRESS": cluster.address, "CHATLEARN_FAKE_GPUS": "4"})
    check_two_nodes(run_dir, one_node_run)
    lose_the_second_node(cluster, second, tiny_model_dir, tmp_path, shipped_reward)
    too_small(cluster, tiny_model_dir, tmp_path)


def test_the_joined_clusters_head_going_away_ends_the_run_in_one_line_and_a_rerun_resumes(
        two_node_cluster, prefect_api, tiny_model_dir, tmp_path):
    """The cluster's GCS server is SIGKILLed while a run that joined it trains: once it has not answered for half
    of Ray's reconnect window (20 s here: 10 s), the run ends with one line naming the head's address, exit 1,
    before Ray's client would end it; its flow run is Crashed and its model processes exit. Re-run (on a local
    Ray, the cluster being gone), it resumes from the last checkpoint."""
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL

    cluster, _ = two_node_cluster
    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(tmp_path), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               PREFECT_API_URL=PREFECT_API_URL.value(), RAY_ADDRESS=cluster.address,
               RAY_gcs_rpc_server_reconnect_timeout_s="20")
    # more episodes than the 10 s can hold, so the head's loss is what ends the run
    args = [*SMALL, "runtime.num_episode=30", "runtime.save_episode_interval=1", "runtime.exp_name=head-gone"]
    proc = subprocess.Popen([sys.executable, "-m", "chatlearn.cli", "train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "head-gone"
    metrics = run_dir / "metrics.jsonl"
    for _ in range(3000):
        if proc.poll() is not None or (metrics.exists() and metrics.read_text().strip()):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    gcs = cluster.head_node.all_processes["gcs_server"][0].process
    gcs.kill()
    killed = time.monotonic()
    _, err = proc.communicate(timeout=300)
    exited = time.monotonic()
    ended = exited - killed
    assert proc.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("chatlearn: error:")]
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1], err[-3000:]
    assert errors[0].startswith(f"chatlearn: error: the Ray head at {cluster.address} went away during episode "), \
        errors
    assert "(its GCS has not answered for 10 s); the run's model processes end with it. Re-run the same command " \
           "once the cluster is back to resume from the last checkpoint" in errors[0], errors
    # ours, not Ray's client ending the process (its line, exit 1 too, 20 s after the GCS went)
    assert "Traceback" not in err and "Failed to connect to GCS" not in err, err[-3000:]
    assert ended >= 10, ended  # the grace was given

    record = json.loads((run_dir / ".flow_run.json").read_text())
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(record["flow_run_id"]).state.type == StateType.CRASHED
    # the model processes were asked to exit: gone after the call they were in, long before the cluster's raylets
    # would give up on the GCS and take them along (300 s, the fixture)
    ranks = json.loads((run_dir / "placement.json").read_text())["ranks"]
    pids = {r["pid"] for reps in ranks.values() for rep in reps for r in rep}
    while pids and time.monotonic() - exited < 30:
        pids = {pid for pid in pids if _alive(pid)}
        time.sleep(0.2)
    assert not pids, f"model processes still running: {pids}"

    done = len(metrics.read_text().splitlines())  # episodes run before the head's loss was noticed
    env.pop("RAY_ADDRESS")
    rerun = subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", *args[:-3],
                            f"runtime.num_episode={done + 1}", *args[-2:]], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert re.search(r"resuming after episode \d+ ", rerun.stderr), rerun.stderr[-3000:]
    assert [r["episode"] for r in rows(run_dir)] == list(range(1, done + 2))
    assert (run_dir / "final" / "policy" / "model.safetensors").is_file()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def check_two_nodes(run_dir, one_node_run):
    placement = json.loads((run_dir / "placement.json").read_text())
    head, second = placement["nodes"]
    on = {name: {r["node_id"] for rep in reps for r in rep} for name, reps in placement["ranks"].items()}
    assert on["policy"] == on["reference"] == on["value"] == {head}
    assert on["ppo_policy"] == on["ppo_value"] == {second}
    assert on["reward"] == {head, second}  # SPREAD: one replica per node
    offloaded = rows(one_node_run)
    assert all(r.pop("handover_mb") > 0 for r in offloaded)
    assert rows(run_dir) == offloaded
    assert all("handover_mb" not in r for r in rows(run_dir))
    assert_same_weights(final_policy(run_dir), final_policy(one_node_run))


def lose_the_second_node(cluster, second, tiny_model_dir, tmp_path, shipped_reward):
    # the trainers run on the second node (its one GPU); losing that node mid-run leaves 3 GPUs for a layout
    # of 4: the run recreates what it can, finds the layout no longer fits, and fails naming the lost node
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(tmp_path), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               PREFECT_API_URL=PREFECT_API_URL.value(), RAY_ADDRESS=cluster.address, CHATLEARN_FAKE_GPUS="4")
    args = [*SMALL, "runtime.num_episode=20", "runtime.save_episode_interval=1", *GPU_LAYOUT, *shipped_reward,
            "runtime.exp_name=lose-node"]
    proc = subprocess.Popen([sys.executable, "-m", "chatlearn.cli", "train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "lose-node" / "metrics.jsonl"
    for _ in range(3000):
        if proc.poll() is not None or (metrics.exists() and metrics.read_text().strip()):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    cluster.remove_node(second)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("chatlearn: error:")]
    assert len(errors) == 1, err[-3000:]
    assert "left the cluster" in errors[0] and "no longer fits the remaining cluster" in errors[0], errors[0]
    assert second.node_id[:12] in errors[0], errors[0]


def too_small(cluster, tiny_model_dir, tmp_path):
    # joining a cluster, the plan needs the live nodes, so the layout is checked inside the train flow (after
    # the Prefect flow run exists): still the one line on the terminal, no traceback, nothing written
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(tmp_path), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               PREFECT_API_URL=PREFECT_API_URL.value(), RAY_ADDRESS=cluster.address)
    res = subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", *SMALL, *GPU_LAYOUT,
                          "runtime.exp_name=too-small"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "Finished in state Failed" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.splitlines()[-1] == (
        "chatlearn: placement: the config needs more than the cluster has: GPUs: 4 required, 3 available (1 node(s): "
        "3 GPUs); per model: colocation group 'policy,reference,value' 3 (policy 3, reference 1, value 2); colocation "
        "group 'ppo_policy,ppo_value' 1 (ppo_policy 1, ppo_value 1)"), res.stderr[-3000:]
    assert not (tmp_path / "too-small" / "metrics.jsonl").exists()
