"""Storage faults: a write that fails (disk full, a file in the way, read-only) is one `RunError` line naming the
path and the OS error, no half-written directory or record is left as the resume point, and the previous
checkpoint still loads and is still `latest`.

The full disk comes from the `checkpoint_write` fault point (`CHATLEARN_FAULT_AT`, chatlearn/utils/faults.py:
an `OSError(ENOSPC)` halfway through a model checkpoint) or from monkeypatched writes; as root, one test also
fills a real 64 KiB tmpfs. The last test is a real `chatlearn train` whose second checkpoint fails.
"""

import errno
import json
import os
import re
import subprocess
import traceback

import pytest
import torch

from chatlearn.checkpoint.data_checkpoint import LATEST, DataCheckpoint, DataCheckpointStore
from chatlearn.checkpoint.model_checkpoint import load_model_checkpoint, save_model_checkpoint
from chatlearn.utils.errors import RunError
from chatlearn.utils.storage import ensure_writable_dir, os_error_of, writing
from tests.conftest import chatlearn_train

ENOSPC = "[Errno 28] No space left on device"
ENOSPC_RE = re.escape(ENOSPC)


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3).state_dict()


def save(path, seed: int) -> str:
    opt = {"state": {0: {"step": torch.tensor(float(seed))}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    return save_model_checkpoint(str(path), weights(seed), optimizer=opt, rng={"seed": seed},
                                 meta={"iteration": seed})


def record(iteration: int, ckpt: str) -> DataCheckpoint:
    return DataCheckpoint(episode=iteration // 4 - 1, consumed_samples=8 * iteration, train_iteration=iteration,
                          sample_per_episode=8, seed=1, model_checkpoints={"policy": ckpt})


def leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".tmp" in n or ".old-" in n)


def test_a_full_disk_halfway_through_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    models = tmp_path / "checkpoints" / "policy"
    store = DataCheckpointStore(str(tmp_path / "data_checkpoints"))
    store.write(record(4, save(models / "iter_0000004", 4)))

    monkeypatch.setenv("CHATLEARN_FAULT_AT", "checkpoint_write:8")
    target = models / "iter_0000008"
    with pytest.raises(RunError) as info:
        save(target, 8)
    assert str(info.value) == f"cannot write checkpoint to {target}: {ENOSPC}"
    assert "\n" not in str(info.value)
    assert sorted(os.listdir(models)) == ["iter_0000004"]  # no iter_8, no temporary directory
    # the previous checkpoint is still the resume point, and loads
    assert store.latest_good().train_iteration == 4
    assert json.loads(json.loads((tmp_path / "data_checkpoints" / LATEST).read_text())["result"])["key"] == \
        "iter_0000004"
    state = load_model_checkpoint(str(models / "iter_0000004"))
    assert all(torch.equal(state["weights"][k], v) for k, v in weights(4).items())


def test_safetensors_and_torch_errors_are_reported_with_their_errno(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import chatlearn.checkpoint.model_checkpoint as mc

    save(tmp_path / "iter_0000004", 4)

    def full(*args, **kwargs):  # what safetensors raises on a full disk (seen on a real tmpfs)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(mc, "save_file", full)
    with pytest.raises(RunError, match=rf"^cannot write checkpoint to {tmp_path}/iter_0000008: \[Errno 28\] "):
        save(tmp_path / "iter_0000008", 8)
    monkeypatch.undo()

    def read_only(obj, f, *args, **kwargs):  # torch writes through our file object: a plain OSError
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(mc.torch, "save", read_only)
    with pytest.raises(RunError, match=r"iter_0000008: \[Errno 30\] Read-only file system$"):
        save(tmp_path / "iter_0000008", 8)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004"]
    assert load_model_checkpoint(str(tmp_path / "iter_0000004"))["meta"] == {"iteration": 4}


def test_a_checkpoint_under_a_file_names_the_path(tmp_path):
    (tmp_path / "checkpoints").write_text("not a directory")
    target = tmp_path / "checkpoints" / "policy" / "iter_0000004"
    with pytest.raises(RunError) as info:
        save(target, 4)
    assert str(info.value) == f"cannot write checkpoint to {target}: [Errno 20] Not a directory"
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]


def test_a_real_full_disk(tmp_path):
    """A 64 KiB tmpfs (root only): safetensors, torch.save and the manifest really fail with ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        save(mnt / "iter_0000004", 4)  # tiny: fits
        big = {"w": torch.zeros(64 * 1024)}  # 256 KiB
        with pytest.raises(RunError, match=rf"^cannot write checkpoint to {mnt}/iter_0000008: {ENOSPC_RE}$"):
            save_model_checkpoint(str(mnt / "iter_0000008"), big)
        with pytest.raises(RunError, match=ENOSPC_RE):  # the weights fit, the optimizer state does not
            save_model_checkpoint(str(mnt / "iter_0000012"), {"w": torch.zeros(4)}, optimizer=big)
        assert sorted(os.listdir(mnt)) == ["iter_0000004"]
        assert load_model_checkpoint(str(mnt / "iter_0000004"))["meta"] == {"iteration": 4}
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_data_checkpoint_that_cannot_be_written_keeps_the_previous_latest(tmp_path, monkeypatch):
    ckpt = save(tmp_path / "m" / "iter_0000004", 4)
    store = DataCheckpointStore(str(tmp_path / "dc"))
    store.write(record(4, ckpt))
    ckpt8 = save(tmp_path / "m" / "iter_0000008", 8)
    real_replace = os.replace

    def full_at(name):
        def replace(src, dst, *args, **kwargs):
            if os.path.basename(dst) == name:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_replace(src, dst, *args, **kwargs)
        return replace

    for failing in ("iter_0000008", LATEST):  # the record itself, then only its `latest` pointer
        monkeypatch.setattr(os, "replace", full_at(failing))
        with pytest.raises(RunError) as info:
            store.write(record(8, ckpt8))
        monkeypatch.setattr(os, "replace", real_replace)
        assert str(info.value) == f"cannot write data checkpoint to {tmp_path / 'dc' / failing}: {ENOSPC}"
        assert store.iterations() == [4] and leftovers(tmp_path / "dc") == []
        assert store.latest_good().train_iteration == 4
        assert json.loads(json.loads((tmp_path / "dc" / LATEST).read_text())["result"])["train_iteration"] == 4


def test_a_data_checkpoint_directory_that_is_a_file(tmp_path):
    (tmp_path / "dc").write_text("x")
    store = DataCheckpointStore(str(tmp_path / "dc"))
    with pytest.raises(RunError, match=r"^cannot write data checkpoint to .*/dc/iter_0000004: \[Errno 17\] File e"):
        store.write(record(4, "unused"))


def test_metrics_and_curves_that_cannot_be_written(tmp_path, monkeypatch):
    from chatlearn.config import load_config
    from chatlearn.runtime.records.reporting import EpisodeReporter, write_curves

    cfg = load_config(None, [f"runtime.output_dir={tmp_path}", "runtime.num_episode=2"])
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl.tmp").mkdir()  # a directory in the way of the rewrite
    with pytest.raises(RunError, match=r"^cannot write metrics to .*/a/metrics.jsonl: \[Errno 21\] Is a directory$"):
        EpisodeReporter(cfg, tmp_path / "a")
    assert leftovers(tmp_path / "a") == []

    reporter = EpisodeReporter(cfg, tmp_path)
    reporter.record({"episode": 0, "reward_mean": 0.5})
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(RunError, match=rf"^cannot write metrics to {tmp_path}/metrics.jsonl: {ENOSPC_RE}$"):
        reporter.record({"episode": 1, "reward_mean": 0.6})
    reporter.close()
    monkeypatch.undo()
    (tmp_path / "curves.png").mkdir()
    with pytest.raises(RunError, match=r"^cannot write the curves to .*/curves.png: \[Errno 21\]"):
        write_curves([{"episode": 0, "reward_mean": 0.5}], tmp_path / "curves.png")
    assert leftovers(tmp_path) == []


def test_up_front_checks_name_the_directory(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunError, match=r"^cannot create the run directory .*/file: \[Errno 17\] File exists \(a file"):
        ensure_writable_dir(tmp_path / "file", "run directory")
    with pytest.raises(RunError, match=r"^cannot create the model checkpoint directory .*/file/sub: \[Errno 20\]"):
        ensure_writable_dir(tmp_path / "file" / "sub", "model checkpoint directory")

    import tempfile

    def read_only(*args, **kwargs):  # root ignores chmod: the read-only filesystem's error instead
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(RunError, match=r"^cannot write to the run directory .*/ro: \[Errno 30\] Read-only file sys"):
        ensure_writable_dir(tmp_path / "ro", "run directory")


def test_the_config_checkpoint_dirs_are_checked_with_the_lock(tmp_path):
    from chatlearn.checkpoint.resume import checkpoint_dirs
    from chatlearn.config import load_config
    from chatlearn.runtime.records.run_lock import lock_run_dir, read_holder

    cfg = load_config(None, [f"runtime.output_dir={tmp_path}", "runtime.save_episode_interval=1",
                             f"runtime.data_checkpoint_path={tmp_path}/file/dc"])
    (tmp_path / "file").write_text("x")
    assert [what for _, what in checkpoint_dirs(cfg)] == ["model checkpoint directory", "data checkpoint directory"]
    with pytest.raises(RunError, match=r"^cannot create the data checkpoint directory .*/file/dc: \[Errno 20\]"):
        lock_run_dir(cfg.runtime.run_dir, checkpoint_dirs(cfg))
    with lock_run_dir(cfg.runtime.run_dir):  # the failed check gave the lock back
        assert read_holder(cfg.runtime.run_dir)["pid"] == os.getpid()
    # the last episode always checkpoints (a finished run is resumable), so no interval still writes them
    no_interval = load_config(None, [f"runtime.output_dir={tmp_path}", "runtime.save_episode_interval=0"])
    assert [what for _, what in checkpoint_dirs(no_interval)] == ["model checkpoint directory",
                                                                  "data checkpoint directory"]


def test_errors_wrapped_by_ray_and_dcp_are_found():
    from ray.exceptions import RayTaskError
    from torch.distributed.checkpoint.api import CheckpointException

    from chatlearn.checkpoint.dist_checkpoint import _os_error_in

    def from_actor(exc):
        try:
            raise exc
        except BaseException as e:
            return RayTaskError("save_checkpoint", traceback.format_exc(), e).as_instanceof_cause()

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(RunError, match=rf"^cannot write the final policy to x: {ENOSPC_RE}$"):
        with writing("the final policy", "x"):
            raise from_actor(full)
    own = RunError("cannot write checkpoint to y: [Errno 28] No space left on device")
    with pytest.raises(RayTaskError) as info:  # a RunError from the actor passes unchanged
        with writing("the final policy", "x"):
            raise from_actor(own)
    assert os_error_of(info.value) is None
    with pytest.raises(ValueError):  # not a storage fault: unchanged
        with writing("the final policy", "x"):
            raise ValueError("bad")
    dcp_error = CheckpointException("save failed", {1: (full, traceback.StackSummary())})
    assert _os_error_in(dcp_error) is full


def test_a_sharded_checkpoint_fails_the_same_way(tmp_path, monkeypatch):
    from chatlearn.checkpoint.dist_checkpoint import load_sharded, save_sharded

    model = torch.nn.Linear(4, 3)
    save_sharded(str(tmp_path / "iter_0000004"), model, None, None, None, meta={"iteration": 4})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv("CHATLEARN_FAULT_AT", "checkpoint_write:8")
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(RunError, match=rf"^cannot write checkpoint to {tmp_path}/iter_0000008: {ENOSPC_RE}$"):
        save_sharded(str(tmp_path / "iter_0000008"), model, None, None, None)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004"]
    assert load_sharded(str(tmp_path / "iter_0000004"), model, None, None, None) == {"iteration": 4}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


# -- a real run ---------------------------------------------------------------------------------------------------

SMALL = ["runtime.num_episode=2", "runtime.sample_per_episode=32", "runtime.generation_batch_size=16",
         "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.save_episode_interval=1",
         "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false", "runtime.exp_name=full"]


def train(out, tiny_model_dir, fault=None):
    return chatlearn_train(SMALL, out, tiny_model_dir, CHATLEARN_FAULT_AT=fault)


@pytest.mark.integration
def test_a_full_disk_at_the_second_checkpoint_fails_the_run_and_keeps_the_first(prefect_api, tiny_model_dir,
                                                                                   tmp_path):
    run_dir = tmp_path / "full"
    # two trainer steps per episode: episode 1 checkpoints iteration 2, episode 2 iteration 4 (which fails)
    failed = train(tmp_path, tiny_model_dir, fault="checkpoint_write:4")
    assert failed.returncode == 1, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("chatlearn: error:")]
    assert len(errors) == 1, failed.stderr[-3000:]
    # "chatlearn: error: episode 2, checkpoint: cannot write checkpoint to .../ppo_policy/iter_0000004: ..."
    assert errors[0].startswith(f"chatlearn: error: episode 2, checkpoint: cannot write checkpoint to {run_dir}/"
                                "checkpoints/ppo_"), errors[0]
    assert errors[0].endswith(f"/iter_0000004: {ENOSPC}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [1]
    for model in ("ppo_policy", "ppo_value"):  # nothing of iteration 4, no temporary directory
        assert sorted(os.listdir(run_dir / "checkpoints" / model)) == ["iter_0000002"]
    assert DataCheckpointStore(str(run_dir / "data_checkpoints")).latest_good().train_iteration == 2

    # the previous checkpoint loads (its files pass their checksums); a re-run resuming from a record is
    # tests/test_resume.py
    for model in ("ppo_policy", "ppo_value"):
        state = load_model_checkpoint(str(run_dir / "checkpoints" / model / "iter_0000002"))
        assert state["weights"] and all(torch.isfinite(t).all() for t in state["weights"].values())
