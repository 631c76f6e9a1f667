"""Model checkpoints (atomic, checksummed, no unpickling) and data checkpoint records (Prefect result storage)."""

import json
import logging
import os

import pytest
import torch

from chatlearn.checkpoint.data_checkpoint import DataCheckpoint, DataCheckpointStore
from chatlearn.checkpoint.model_checkpoint import (
    CheckpointError,
    capture_rng_state,
    load_model_checkpoint,
    restore_rng_state,
    save_model_checkpoint,
)


def make_model_ckpt(path, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    sched.step()
    save_model_checkpoint(str(path), model.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                          rng=capture_rng_state(), meta={"iteration": 3})
    return model, opt, sched


def test_model_checkpoint_round_trip(tmp_path):
    model, opt, sched = make_model_ckpt(tmp_path / "ck")
    state = load_model_checkpoint(str(tmp_path / "ck"))
    assert all(torch.equal(state["weights"][k], v) for k, v in model.state_dict().items())
    assert state["optimizer"]["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert state["scheduler"]["last_epoch"] == sched.state_dict()["last_epoch"] == 1
    assert state["meta"] == {"iteration": 3}
    # the RNG state restores the exact stream
    restore_rng_state(state["rng"])
    a = torch.rand(3)
    restore_rng_state(state["rng"])
    assert torch.equal(torch.rand(3), a)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp dirs left


def test_corrupt_or_incomplete_model_checkpoint_is_reported(tmp_path):
    make_model_ckpt(tmp_path / "ck")
    with open(tmp_path / "ck" / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_model_checkpoint(str(tmp_path / "ck"))
    make_model_ckpt(tmp_path / "ck2")
    os.remove(tmp_path / "ck2" / "manifest.json")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_model_checkpoint(str(tmp_path / "ck2"))


def test_optimizer_state_loading_refuses_arbitrary_pickles(tmp_path):
    make_model_ckpt(tmp_path / "ck")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"state": Evil()}, tmp_path / "ck" / "optimizer.pt")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    from chatlearn.checkpoint.model_checkpoint import sha256_file

    manifest["files"]["optimizer.pt"] = sha256_file(str(tmp_path / "ck" / "optimizer.pt"))
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        load_model_checkpoint(str(tmp_path / "ck"))


def record(tmp_path, iteration, episode):
    ck = tmp_path / "models" / f"iter_{iteration}"
    make_model_ckpt(ck, seed=iteration)
    return DataCheckpoint(episode=episode, consumed_samples=16 * (episode + 1), train_iteration=iteration,
                          sample_per_episode=16, seed=1, model_checkpoints={"ppo_policy": str(ck)})


def test_data_checkpoints_latest_pointer_and_fallback_to_newest_good(tmp_path, caplog):
    store = DataCheckpointStore(str(tmp_path / "data"))
    for it, ep in [(2, 0), (4, 1), (6, 2)]:
        store.write(record(tmp_path, it, ep))
    assert store.iterations() == [2, 4, 6]
    latest = json.loads(json.loads((tmp_path / "data" / "latest").read_text())["result"])
    assert latest == {"key": "iter_0000006", "episode": 2, "train_iteration": 6}
    # the files are Prefect result records (JSON serializer)
    outer = json.loads((tmp_path / "data" / "iter_0000004").read_text())
    assert outer["metadata"]["serializer"]["type"] == "json"
    assert store.latest_good().train_iteration == 6

    # newest record half-written (cut short) -> reported, the previous one is used
    path = tmp_path / "data" / "iter_0000006"
    path.write_text(path.read_text()[:50])
    with caplog.at_level(logging.WARNING, logger="chatlearn.checkpoint"):
        assert store.latest_good().train_iteration == 4
    assert "iter_0000006" in caplog.text and "unreadable" in caplog.text

    # a record whose model checkpoint is corrupt is skipped too
    with open(tmp_path / "models" / "iter_4" / "model.safetensors", "r+b") as f:
        f.seek(-2, 2)
        f.write(b"\xff\xff")
    assert store.latest_good().train_iteration == 2
    with pytest.raises(CheckpointError, match="model checkpoint of 'ppo_policy' is bad"):
        store.read(4)


def test_records_with_a_non_json_serializer_are_refused(tmp_path):
    store = DataCheckpointStore(str(tmp_path / "data"))
    store.write(record(tmp_path, 2, 0))
    path = tmp_path / "data" / "iter_0000002"
    outer = json.loads(path.read_text())
    outer["metadata"]["serializer"]["type"] = "pickle"
    path.write_text(json.dumps(outer))
    with pytest.raises(CheckpointError, match="serializer 'pickle' refused"):
        store.read(2)


def test_prune_keeps_newest_n_and_their_files(tmp_path):
    store = DataCheckpointStore(str(tmp_path / "data"))
    for it, ep in [(2, 0), (4, 1), (6, 2), (8, 3)]:
        store.write(record(tmp_path, it, ep))
    assert store.prune(2) == [2, 4]
    assert store.iterations() == [6, 8]
    assert sorted(os.listdir(tmp_path / "models")) == ["iter_6", "iter_8"]


def test_a_crash_mid_write_leaves_only_a_temp_file(tmp_path):
    store = DataCheckpointStore(str(tmp_path / "data"))
    store.write(record(tmp_path, 2, 0))

    def crash():
        raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        store.write(record(tmp_path, 4, 1), crash_hook=crash)
    assert store.iterations() == [2]
    assert store.latest_good().train_iteration == 2
    assert json.loads(json.loads((tmp_path / "data" / "latest").read_text())["result"])["train_iteration"] == 2
    store.write(record(tmp_path, 4, 1))  # the retry replaces the leftover temp file
    assert store.iterations() == [2, 4] and not (tmp_path / "data" / "iter_0000004.tmp").exists()
