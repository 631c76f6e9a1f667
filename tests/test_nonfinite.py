"""Non-finite numbers stop the run, not the model (issue 12, item 2).

A NaN or infinite reward, advantage, loss or gradient norm is a `RunError` naming where it came from, before the
optimizer steps on it; no checkpoint holds a non-finite tensor; `metrics.jsonl` is strict JSON. Unit tests of
each check (no Ray), then one real `chatlearn train` whose reward hook returns NaN for one sample of its second
episode: exit 1, one `chatlearn: error:` line and no traceback on the terminal, episode 0's checkpoint intact,
nothing written for episode 1, no final policy.
"""

import datetime
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from chatlearn.checkpoint.model_checkpoint import save_model_checkpoint
from chatlearn.models.hf.reward import RuleReward
from chatlearn.models.hf.trainer import optimizer_step
from chatlearn.models.rule import RewardError, hook_name, score_samples
from chatlearn.models.torch_module import TorchModule
from chatlearn.runtime.records.reporting import EpisodeReporter, json_line
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig
from chatlearn.utils.errors import RunError
from chatlearn.utils.finite import check_finite_tensors, nonfinite_summary, require_finite
from tests.conftest import REPO

NAN, INF = float("nan"), float("inf")
SAMPLES = [{"sample_id": 36, "prompt": "max 1 2 ?", "response": "2", "answer": "2"},
           {"sample_id": 37, "prompt": "max 7 3 ?", "response": "1", "answer": "7"}]


def strict_loads(line: str):
    """json.loads that refuses NaN / Infinity (Python's default reader takes them; other readers do not)."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


# -- the checks ------------------------------------------------------------------------------------------------

def test_summaries_say_what_is_not_finite():
    assert nonfinite_summary(1.5) is None and nonfinite_summary(torch.ones(3)) is None
    assert nonfinite_summary(torch.tensor([1, 2])) is None  # integer tensors cannot hold NaN
    assert nonfinite_summary(NAN) == "nan" and nonfinite_summary(-INF) == "-inf"
    assert nonfinite_summary(torch.tensor([1.0, NAN, INF, NAN])) == "nan in 2 and inf in 1 of 4 values"
    with pytest.raises(RunError, match="^policy: gradient norm is inf; no step$"):
        require_finite(INF, "policy: gradient norm", "; no step")


@pytest.mark.parametrize("bad", [NAN, INF, -INF, "0.5", None, True, torch.tensor(0.5)])
def test_a_rule_reward_that_is_not_a_finite_number_names_the_hook_and_the_sample(bad):
    def reward(sample):
        return bad if sample["sample_id"] == 37 else 1.0

    with pytest.raises(RewardError) as info:
        score_samples(reward, SAMPLES, 5, hook_name("mod:reward"), episode_start=32)
    assert isinstance(info.value, RunError)  # the CLI prints it as one line
    assert str(info.value) == (f"reward hook mod:reward returned {bad!r} for sample 5 (sample_id 37, prompt "
                               f'"max 7 3 ?"); expected a finite number')


def test_a_nonfinite_score_or_advantage_in_the_experience_names_the_sample():
    reward = RuleReward("reward")
    reward.bind(ModelConfig(num_cpu=1, args_dict={"reward_fn": "chatlearn.tasks.max_digit:max_digit_reward",
                                                  "advantage_estimator": "gae"}), RuntimeConfig(), 0, seed=7)
    reward.setup()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    data = {"prompt": ["max 1 2 ?", "max 7 3 ?"], "sample_id": [36, 37], "response_mask": mask,
            "logprobs": torch.tensor([[-1.0, -2.0, -INF], [-1.0, -1.0, -1.0]]),  # -inf on padding: fine
            "ref_logprobs": torch.full((2, 3), -1.5), "values": torch.zeros(2, 3)}
    out = reward.make_experience(data, torch.tensor([1.0, 0.0]))
    assert bool(torch.isfinite(out["advantages"]).all())
    # an infinite score is an error before the clip to +-score_clip would hide it
    with pytest.raises(RunError, match=r'^reward: non-finite score \(inf\) for sample_id 37 \(prompt "max 7 3 \?"\)$'):
        reward.make_experience(data, torch.tensor([1.0, INF]))
    # NaN log-probs would make NaN advantages through the KL penalty: the input is named
    bad = dict(data, logprobs=torch.tensor([[-1.0, NAN, 0.0], [-1.0, -1.0, -1.0]]))
    with pytest.raises(RunError, match=r"^reward: non-finite policy log-probs \(nan in 1 of 2 values\) for "
                                       r"sample_id 36 .*its advantages would be too$"):
        reward.make_experience(bad, torch.tensor([1.0, 0.0]))
    # GRPO: group advantages of NaN scores never get computed
    grpo = {"prompt": ["a", "b"], "sample_id": [0, 1], "group_id": [0, 0]}
    with pytest.raises(RunError, match=r"non-finite score \(nan\) for sample_id 1 \(prompt \"b\"\)"):
        reward.make_experience(grpo, torch.tensor([0.0, NAN]))


class _Linear(TorchModule):
    def __init__(self) -> None:
        super().__init__("ppo_policy")
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)


def test_a_nonfinite_loss_or_gradient_norm_stops_before_the_optimizer_step():
    mod = _Linear()
    before = {k: v.clone() for k, v in mod.model.state_dict().items()}
    loss = mod.model(torch.ones(2, 4)).sum() * NAN
    loss.backward()
    with pytest.raises(RunError, match=r"^ppo_policy: policy_loss is nan; the optimizer step was not taken$"):
        optimizer_step(mod, 1.0, "policy", losses={"policy_loss": float(loss.detach()), "clipfrac": NAN})
    # the loss was fine but a gradient is not (an overflow in the backward)
    mod.optimizer.zero_grad()
    mod.model(torch.ones(2, 4)).sum().backward()
    mod.model.weight.grad[0, 1] = INF
    with pytest.raises(RunError, match=r"^ppo_policy: gradient norm is inf; the optimizer step was not taken$"):
        optimizer_step(mod, 1.0, "policy", losses={"policy_loss": 0.5})
    assert all(torch.equal(v, before[k]) for k, v in mod.model.state_dict().items())  # the weights never moved
    mod.optimizer.zero_grad()
    mod.model(torch.ones(2, 4)).sum().backward()
    stats = optimizer_step(mod, 1.0, "policy", losses={"policy_loss": 0.5})
    assert stats["policy_grad_norm"] > 0 and not torch.equal(mod.model.weight, before["weight"])


def test_a_checkpoint_with_a_nonfinite_tensor_is_not_written(tmp_path):
    good = {"w": torch.ones(3), "b": torch.zeros(2)}
    path = str(tmp_path / "ck" / "iter_0000004")
    with pytest.raises(RunError, match=rf"^checkpoint {path} not written: weight w has nan in 1 of 3 values$"):
        save_model_checkpoint(path, {**good, "w": torch.tensor([1.0, NAN, 2.0])})
    optimizer = {"state": {0: {"exp_avg": torch.tensor([INF])}}, "param_groups": []}
    with pytest.raises(RunError, match=r"not written: optimizer state state\.0\.exp_avg has value inf$"):
        save_model_checkpoint(path, good, optimizer=optimizer)
    assert os.listdir(tmp_path) == []  # not even a temporary directory
    save_model_checkpoint(path, good)
    assert sorted(os.listdir(tmp_path / "ck")) == ["iter_0000004"]
    with pytest.raises(RunError, match=r"^at \[0\]\.x has nan in 1 of 2 values$"):
        check_finite_tensors([{"x": torch.tensor([NAN, 1.0])}], "at")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_save_worker(rank: int, port: int, path: str, out: dict) -> None:
    """One rank of a 2-rank FSDP2 model on gloo; rank 1's shard of ``1.weight`` holds a NaN."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from chatlearn.checkpoint.dist_checkpoint import save_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        optimizer = torch.optim.AdamW(model.parameters())
        local = model[1].weight.to_local()  # rows split by rank: (2, 8) -> one row of 8 values each
        if rank == 1:
            with torch.no_grad():
                local[0, 3] = NAN
        t0 = time.monotonic()
        try:
            save_sharded(path, model, optimizer, None, dist.group.WORLD, meta={"model": "ppo_policy"})
            out[rank] = "written"
        except RunError as exc:
            out[rank] = str(exc)
        out[f"seconds{rank}"] = time.monotonic() - t0
        out[f"exists{rank}"] = os.path.exists(path) or os.path.exists(f"{path}.tmp-dcp")
        with torch.no_grad():
            local.nan_to_num_(0.0)
        save_sharded(path, model, optimizer, None, dist.group.WORLD, meta={"model": "ppo_policy"})  # group intact
        out[f"after{rank}"] = os.path.isdir(path)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_nan_in_one_ranks_shard_stops_every_rank_with_the_same_error(tmp_path):
    """Sharded (FSDP2) checkpoint on a real 2-rank gloo group: rank 1's shard holds a NaN, rank 0's does not.
    Both ranks raise the same RunError naming the model, the tensor and the rank, at once (neither waits for
    the group's timeout in a barrier the other never reaches), nothing is written, and the group still works."""
    path = str(tmp_path / "ck" / "ppo_policy" / "iter_0000002")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_sharded_save_worker, args=(_free_port(), path, out), nprocs=2, join=True)
        result = dict(out)
    expected = (f"checkpoint {path} not written: ppo_policy weight 1.weight has nan in 1 of 8 values "
                "(in rank 1's shard)")
    assert result[0] == result[1] == expected, result
    assert max(result["seconds0"], result["seconds1"]) < 20, result  # the group's timeout is 60 s
    assert not result["exists0"] and not result["exists1"]
    assert result["after0"] and result["after1"]


def test_metrics_jsonl_is_strict_json(tmp_path):
    from chatlearn.config import load_config

    row = {"episode": 0, "reward_mean": 0.5, "eval_reward_mean": NAN, "kl_mean": -INF,
           "stage_seconds": {"score": INF}, "pair": (1.0, NAN), "np": torch.tensor(1.0)}
    assert strict_loads(json_line(row)) == {"episode": 0, "reward_mean": 0.5, "eval_reward_mean": None,
                                            "kl_mean": None, "stage_seconds": {"score": None}, "pair": [1.0, None],
                                            "np": "tensor(1.)"}
    cfg = load_config(None, ["runtime.num_episode=2", "runtime.log_interval=100"])
    (tmp_path / "metrics.jsonl").write_text('{"episode": 1, "kl_mean": NaN}\n')  # written by an older version
    reporter = EpisodeReporter(cfg, tmp_path, first_episode=1)
    reporter.record({"episode": 1, "reward_mean": 0.25, "eval_reward_mean": NAN, "checkpoint_paths": {}})
    reporter.close()
    rows = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"episode": 1, "kl_mean": None},  # the rows count episodes from 1, the train flow from 0
                    {"episode": 2, "reward_mean": 0.25, "eval_reward_mean": None, "checkpoint_paths": {}}]


# -- a real run ------------------------------------------------------------------------------------------------

NAN_HOOK = '''
def reward(sample):
    """NaN for one sample of the second episode (sample_per_episode 32: sample_id 37 is its sample 5)."""
    return float("nan") if sample["sample_id"] == 37 else 0.5
'''


@pytest.mark.integration
def test_train_with_a_nan_reward_stops_with_one_line_and_writes_no_nan(prefect_api, ray_session, tiny_model_dir,
                                                                       tmp_path):
    from prefect.settings import PREFECT_API_URL

    (tmp_path / "nan_hook.py").write_text(NAN_HOOK)
    # the command's terminal is what is tested: it joins the session's Ray (a local one would be seconds to start
    # and stop), and ships its PYTHONPATH to its workers as a run on any cluster does
    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(tmp_path / "out"), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               PREFECT_API_URL=PREFECT_API_URL.value(), RAY_ADDRESS=ray_session.get_runtime_context().gcs_address,
               PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    args = ["runtime.num_episode=2", "runtime.sample_per_episode=32", "runtime.generation_batch_size=16",
            "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.save_episode_interval=1",
            "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false",
            "models.reward.args_dict.reward_fn=nan_hook:reward"]
    res = subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "chatlearn: error:" in line]
    assert errors == ['chatlearn: error: episode 2, score: reward hook nan_hook:reward returned nan for sample 5 '
                      '(sample_id 37, prompt "' + errors[0].split('prompt "')[1]], res.stderr[-3000:]
    assert errors[0].endswith('"); expected a finite number')
    assert "Traceback" not in res.stderr and "Finished in state Failed" not in res.stderr, res.stderr[-3000:]

    run_dir = tmp_path / "out" / "default"
    log = (run_dir / "chatlearn.log").read_text()
    assert "Traceback" in log and "nan_hook:reward returned nan" in log  # the details are in the run's log
    rows = [strict_loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [1]  # episode 2 never finished
    assert not (run_dir / "final").exists()
    for model in ("ppo_policy", "ppo_value"):  # episode 0's checkpoint (iteration 2) only, every tensor finite
        ckpt = run_dir / "checkpoints" / model
        assert sorted(os.listdir(ckpt)) == ["iter_0000002"]
        weights = load_file(str(ckpt / "iter_0000002" / "model.safetensors"))
        assert all(bool(torch.isfinite(t).all()) for t in weights.values())
