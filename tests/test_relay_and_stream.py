"""Relay buffer, fixed/dynamic episode selection and prompt ranking, with ChatLearn's numbers (chatlearn.md 5.3)."""

import math
import os

import pytest
import torch

from chatlearn.data.ranking import prompt_length, rank_prompts
from chatlearn.data.relay import (
    EpisodeRelayBuffer,
    RelayBuffer,
    RelayCheckpointError,
    concat_all,
    latest_only,
    load_hook,
)
from chatlearn.data.stream import (
    episode_training_samples,
    micro_batches,
    select_episode_samples,
    training_batches,
)

NUM_PROMPTS = 35
SPE = 16


def episode_samples(episode: int, spe: int = SPE, num_prompts: int = NUM_PROMPTS) -> list[dict]:
    """Episode e's samples: the next `spe` values of the stream 0..34, wrapping around."""
    return [
        {"prompt": str(v), "value": torch.tensor(v)} for v in ((episode * spe + k) % num_prompts for k in range(spe))
    ]


def values(samples: list[dict]) -> list[int]:
    return [int(s["value"]) for s in samples]


def test_episode_stream_matches_chatlearn():
    assert values(episode_samples(0)) == list(range(16))
    assert values(episode_samples(1)) == list(range(16, 32))
    # 32, 33, 34 then wrap: 16 - 3 = 13 more, i.e. 0..12
    assert values(episode_samples(2)) == [32, 33, 34] + list(range(13))


# ---------------------------------------------------------------- 5.3 #4: relay buffer


def test_relay_concat_all_window_of_5():
    seen = []

    def hook(buffers):
        seen.append([b.episode_id for b in buffers])
        return concat_all(buffers)

    relay = RelayBuffer(max_relay_episode=5, relay_episode_offset=0, relay_sample_fn=hook)
    assert relay.enabled
    out = [relay.add_episode(e, episode_samples(e)) for e in range(3)]
    # episode 0: 16 samples; episode 1: 16 + 16 = 32; episode 2: 3 * 16 = 48 (window of 5 never full)
    assert values(out[0]) == list(range(16))
    assert values(out[1]) == list(range(32))
    assert values(out[2]) == list(range(35)) + list(range(13))
    assert [len(o) for o in out] == [16, 32, 48]
    assert seen == [[0], [0, 1], [0, 1, 2]]
    assert relay.episodes == [0, 1, 2]

    # Relay output is the training set whatever the loader type; micro 5, global 10:
    micro, global_batch = 5, 10
    assert len(micro_batches(out[2], micro)) == 10  # ceil(48 / 5) = 10
    steps = training_batches(out[2], micro, global_batch)
    assert len(steps) == 5 == math.ceil(48 / 10)  # ceil(48 / 10) = 5
    # each step holds global // micro = 2 micro-batches; last micro-batch = 45..47 -> values 10, 11, 12 then wrap
    assert all(len(step) == 2 for step in steps)
    assert values(steps[-1][-1]) == [10, 11, 12, 0, 1]
    # env (generation) batches per episode with generation batch 4: 16 / 4 = 4
    assert len(micro_batches(episode_samples(2), 4)) == 4


def test_relay_window_of_1_sees_latest_16():
    received = []

    def hook(buffers):
        received.append([values(b.buffer) for b in buffers])
        return concat_all(buffers)

    relay = RelayBuffer(1, 0, hook)
    for e in range(3):
        out = relay.add_episode(e, episode_samples(e))
        assert len(out) == 16 and values(out) == values(episode_samples(e))
    assert received == [[values(episode_samples(e))] for e in range(3)]
    assert relay.episodes == [2]


def test_relay_disabled_never_calls_hook():
    calls = []
    relay = RelayBuffer(0, 0, lambda b: calls.append(b) or concat_all(b))
    assert not relay.enabled
    assert [relay.add_episode(e, episode_samples(e)) for e in range(3)] == [None, None, None]
    assert calls == [] and relay.episodes == []
    RelayBuffer(0, 0, None)  # no hook needed when disabled


def test_relay_enabled_without_hook_raises():
    with pytest.raises(ValueError, match=r"runtime\.max_relay_episode is set .* no relay_sample_fn"):
        RelayBuffer(5, 0, None)
    with pytest.raises(ValueError, match="max_relay_episode"):
        RelayBuffer(True, 0, concat_all)


def test_relay_offset_streams_early_episodes():
    seen = []

    def hook(buffers):
        seen.append([b.episode_id for b in buffers])
        return concat_all(buffers)

    relay = RelayBuffer(5, 1, hook)
    assert relay.add_episode(0, episode_samples(0)) is None
    assert relay.episodes == [] and seen == []
    out = relay.add_episode(1, episode_samples(1))
    assert seen == [[1]] and values(out) == list(range(16, 32))


def test_relay_keep_all_and_latest_only():
    relay = RelayBuffer(-1, 0, latest_only)
    for e in range(7):
        out = relay.add_episode(e, episode_samples(e))
    assert relay.episodes == list(range(7))
    assert values(out) == values(episode_samples(6))
    assert latest_only([]) == []


def test_relay_hook_must_return_list_of_dicts():
    def bad_hook(buffers):
        return tuple(concat_all(buffers))

    relay = RelayBuffer(2, 0, bad_hook)
    with pytest.raises(TypeError, match="bad_hook.*list of sample dicts"):
        relay.add_episode(0, episode_samples(0))
    relay = RelayBuffer(2, 0, lambda b: [1, 2])
    with pytest.raises(TypeError, match="item 0 is a int"):
        relay.add_episode(0, episode_samples(0))


def test_relay_below_minus_one_keeps_every_episode_as_chatlearn():
    # ChatLearn's relay turns any negative max_relay_episode into an unbounded window (data.py: < 0 -> inf)
    relay = RelayBuffer(-3, 0, concat_all)
    for e in range(5):
        out = relay.add_episode(e, episode_samples(e, spe=6))
    assert relay.episodes == [0, 1, 2, 3, 4]
    assert len(out) == 30


@pytest.mark.parametrize("produced", [18, 14])
def test_relay_takes_every_produced_sample_whatever_the_loader_type(produced):
    # ChatLearn 1.0.2's relay branch drains the episode's whole queue into the hook, with the fixed loader
    # too: 18 samples produced for sample_per_episode=16 are all relayed (none cut), and 14 are not an error.
    seen = []

    def hook(buffers):
        seen.append([len(b.buffer) for b in buffers])
        return concat_all(buffers)

    relay = RelayBuffer(2, 0, hook)
    own, train = episode_training_samples(episode_samples(0, spe=produced), 0, relay, "fixed", 16)
    assert len(own) == len(train) == produced and seen == [[produced]]
    own, train = episode_training_samples(episode_samples(1, spe=produced), 1, relay, "fixed", 16)
    assert seen[-1] == [produced, produced] and len(train) == 2 * produced
    assert len(training_batches(train, 4, 8)) == math.ceil(2 * produced / 8)


def test_without_relay_the_loader_type_cuts_the_episode():
    relay = RelayBuffer(2, 3, concat_all)  # relay from episode 3 on: episode 0 streams
    own, train = episode_training_samples(episode_samples(0, spe=18), 0, relay, "fixed", 16)
    assert values(train) == list(range(16)) and own == train
    with pytest.raises(ValueError, match="only 14"):
        episode_training_samples(episode_samples(0, spe=14), 0, relay, "fixed", 16)
    assert len(episode_training_samples(episode_samples(0, spe=18), 0, relay, "dynamic", 16)[1]) == 18


# ---------------------------------------------------------------- 5.3 #5: fixed / dynamic


def test_fixed_16_samples_micro_5_global_10():
    produced = episode_samples(0)
    train = select_episode_samples(produced, "fixed", 16)
    mbs = micro_batches(train, 5)
    # ceil(16 / 5) = 4 micro-batches; the last holds 15 then wraps to 0, 1, 2, 3
    assert [values(mb) for mb in mbs] == [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
        [10, 11, 12, 13, 14],
        [15, 0, 1, 2, 3],
    ]
    assert len(training_batches(train, 5, 10)) == 2  # ceil(16 / 10) = 2


def test_loader_types_select_samples():
    produced = episode_samples(0, spe=20)
    assert values(select_episode_samples(produced, "dynamic", 16)) == list(range(20))
    assert len(training_batches(select_episode_samples(produced, "dynamic", 16), 5, 10)) == 2  # ceil(20/10)
    assert values(select_episode_samples(produced, "FIXED", 16)) == list(range(16))
    with pytest.raises(ValueError, match=r"runtime\.stream_data_loader_type.*sample_per_episode=16.*only 12"):
        select_episode_samples(produced[:12], "fixed", 16)
    assert len(select_episode_samples(produced[:12], "dynamic", 16)) == 12
    with pytest.raises(ValueError, match="unknown runtime.stream_data_loader_type 'relay'"):
        select_episode_samples(produced, "relay", 16)


def test_indivisible_generation_batch_gives_same_micro_batches():
    # 5.3 #9: 16 samples generated in batches of 4 (4 x 4) or 5 (5 + 5 + 5 + 1) train identically
    produced = episode_samples(0)
    by4 = [s for batch in micro_batches(produced, 4) for s in batch]
    by5 = [s for i in range(0, 16, 5) for s in produced[i : i + 5]]
    runs = [training_batches(select_episode_samples(x, "fixed", 16), 5, 10) for x in (by4, by5)]
    assert [[values(mb) for mb in step] for step in runs[0]] == [[values(mb) for mb in step] for step in runs[1]]


# ---------------------------------------------------------------- relay checkpoints


def mixed_samples(episode: int) -> list[dict]:
    return [
        {
            "logprobs": torch.tensor([-0.5 * i, 0.25, float(episode)], dtype=torch.float32),
            "response_ids": torch.tensor([episode, i, 7], dtype=torch.int64),
            "score": torch.tensor(0.5 + i),
            "prompt": f"prompt {episode}-{i} 你好",
            "index": 100 * episode + i,
            "meta": {"tags": ["a", None], "ok": True, "w": 1.5},
        }
        for i in range(3)
    ]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert list(x) == list(y)  # key order kept
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert isinstance(y[k], torch.Tensor) and x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
                assert torch.equal(x[k], y[k]), k
            else:
                assert type(x[k]) is type(y[k]) and x[k] == y[k], k


def test_relay_checkpoint_round_trip(tmp_path):
    relay = RelayBuffer(3, 0, concat_all)
    for e in range(4):
        relay.add_episode(e, mixed_samples(e))
    assert relay.episodes == [1, 2, 3]
    relay.save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["relay.json", "relay.safetensors"]  # no temp files left

    again = RelayBuffer(3, 0, concat_all)
    again.load(str(tmp_path))
    assert again.episodes == [1, 2, 3]
    for b1, b2 in zip(relay.buffers, again.buffers):
        assert b1.episode_id == b2.episode_id
        assert_same(b1.buffer, b2.buffer)
    s = again.buffers[0].buffer[1]
    assert s["score"].dim() == 0 and s["score"].dtype == torch.float32 and s["score"].item() == 1.5
    assert s["response_ids"].dtype == torch.int64 and s["response_ids"].tolist() == [1, 1, 7]
    # the restored window keeps working: adding episode 4 drops episode 1
    out = again.add_episode(4, mixed_samples(4))
    assert again.episodes == [2, 3, 4] and len(out) == 9

    # a smaller current window trims to the newest episodes; the current offset drops earlier ones
    small = RelayBuffer(2, 0, concat_all)
    small.load(str(tmp_path))
    assert small.episodes == [2, 3]
    offset = RelayBuffer(5, 3, concat_all)
    offset.load(str(tmp_path))
    assert offset.episodes == [3]


def test_relay_checkpoint_rejects_non_json_values(tmp_path):
    relay = RelayBuffer(1, 0, concat_all)
    relay.add_episode(0, [{"x": torch.tensor([1.0]), "bad": (1, 2)}])
    with pytest.raises(TypeError, match=r"episode 0 sample 0 field 'bad' is a tuple"):
        relay.save(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "relay.json").exists()


def test_relay_checkpoint_missing(tmp_path):
    relay = RelayBuffer(1, 0, concat_all)
    with pytest.raises(FileNotFoundError, match="nope"):
        relay.load(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"relay\.json"):
        relay.load(str(tmp_path / "empty"))


def test_interrupted_save_never_loads_a_mix(tmp_path, monkeypatch):
    ckpt = str(tmp_path)
    first = RelayBuffer(2, 0, concat_all)
    first.add_episode(0, mixed_samples(0))
    first.save(ckpt)

    second = RelayBuffer(2, 0, concat_all)
    second.add_episode(5, mixed_samples(5))
    real_replace = os.replace

    def failing_on(n):
        calls = []

        def fake(src, dst):
            calls.append(dst)
            if len(calls) == n:
                raise OSError("simulated crash")
            return real_replace(src, dst)

        return fake

    # crash on the first replace: nothing was replaced, the previous checkpoint is intact and loadable
    monkeypatch.setattr(os, "replace", failing_on(1))
    with pytest.raises(OSError, match="simulated crash"):
        second.save(ckpt)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(os.listdir(ckpt)) == ["relay.json", "relay.safetensors"]
    restored = RelayBuffer(2, 0, concat_all)
    restored.load(ckpt)
    assert restored.episodes == [0]
    assert_same(restored.buffers[0].buffer, mixed_samples(0))

    # crash between the two replaces: tensors are new, metadata old -> a clear error, never a mix
    monkeypatch.setattr(os, "replace", failing_on(2))
    with pytest.raises(OSError, match="simulated crash"):
        second.save(ckpt)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(os.listdir(ckpt)) == ["relay.json", "relay.safetensors"]  # temp files cleaned up
    with pytest.raises(RelayCheckpointError, match="torn"):
        RelayBuffer(2, 0, concat_all).load(ckpt)

    # the next complete save repairs it
    second.save(ckpt)
    restored = RelayBuffer(2, 0, concat_all)
    restored.load(ckpt)
    assert restored.episodes == [5]


# ---------------------------------------------------------------- hooks


def test_load_hook():
    assert load_hook("chatlearn.data.relay:concat_all") is concat_all
    assert load_hook("chatlearn.data.relay:RelayBuffer.add_episode") is RelayBuffer.add_episode
    assert load_hook("os.path:join") is os.path.join
    for bad in ("chatlearn.data.relay.concat_all", "a:b:c", ":concat_all", "chatlearn.data.relay:", "m:a..b"):
        with pytest.raises(ValueError, match="must look like 'package.module:function'"):
            load_hook(bad)
    with pytest.raises(ValueError, match=r"'no_such_pkg_xyz\.mod:f'.*cannot import"):
        load_hook("no_such_pkg_xyz.mod:f")
    with pytest.raises(ValueError, match=r"'chatlearn\.data\.relay:missing'.*no attribute"):
        load_hook("chatlearn.data.relay:missing")
    with pytest.raises(ValueError, match="not a callable"):
        load_hook("chatlearn.data.relay:FORMAT_VERSION")


def test_hooks_on_buffers():
    bufs = [EpisodeRelayBuffer(0, [{"v": 1}]), EpisodeRelayBuffer(1, [{"v": 2}, {"v": 3}])]
    assert concat_all(bufs) == [{"v": 1}, {"v": 2}, {"v": 3}]
    assert latest_only(bufs) == [{"v": 2}, {"v": 3}]


# ---------------------------------------------------------------- 5.3 #11: ranking


def test_prompt_length_measure():
    assert prompt_length("hello big world") == 3
    assert prompt_length("  spaced\tout\nwords  ") == 3
    # whitespace words 2 ("你好", "world") + 2 CJK characters = 4
    assert prompt_length("你好 world") == 4
    # 1 word + 4 CJK chars (Extension A \u3400 and compatibility \uf900 count too) = 5
    assert prompt_length("你好\u3400\uf900") == 5
    assert prompt_length("") == 0


def test_rank_prompts_chunks_descending_stable():
    prompts = ["a", "b c d", "e f", "g h", "i", "j k l m", "n o", "你好吗"]
    # lengths:  1,   3,      2,     2,    1,    4,        2,     1 word + 3 CJK = 4
    records = [{"prompt": p, "id": i} for i, p in enumerate(prompts)]
    snapshot = [dict(r) for r in records]
    ranked = rank_prompts(records, 3)
    # chunks [0,1,2] [3,4,5] [6,7] (remainder): lengths [1,3,2] [2,1,4] [2,4]
    assert [r["id"] for r in ranked] == [1, 2, 0, 5, 3, 4, 7, 6]
    assert records == snapshot and ranked is not records
    # ties keep their order: ids 2, 3, 6 all have length 2
    ties = rank_prompts([records[2], records[0], records[3], records[6]], 4)
    assert [r["id"] for r in ties] == [2, 3, 6, 0]
    assert [r["id"] for r in rank_prompts(records, 100)] == [5, 7, 1, 2, 3, 6, 0, 4]
    with pytest.raises(ValueError, match="record 0 has no 'text'"):
        rank_prompts(records, 3, prompt_key="text")
    with pytest.raises(ValueError, match="positive"):
        rank_prompts(records, 0)
