"""Prompt sampling, training-batch streaming and batch split/collate, with ChatLearn's numbers."""

import json

import pytest
import torch

from chatlearn.data.batch import collate_samples, split_batch
from chatlearn.data.prompts import DataError
from chatlearn.data.records import load_records
from chatlearn.data.sampler import episode_prompt_batches, eval_prompt_batches, split_index
from chatlearn.data.stream import micro_batches, training_batches


def test_split_index_gives_earlier_ranks_the_extra_item():
    assert split_index(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_index(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def per_replica(batches, replica):
    return [idx for r, idx in batches if r == replica]


def test_sampler_small_dataset_wraps_within_a_batch():
    # chatlearn.md 5.3 #2: 2 replicas, micro 8, 32 samples/episode, dataset of 3
    b = episode_prompt_batches(3, 0, 32, 8, 2)
    assert per_replica(b, 0)[0] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert per_replica(b, 1)[0] == [2, 0, 1, 2, 0, 1, 2, 0]


def test_sampler_dataset_of_25_across_episodes():
    ep0 = episode_prompt_batches(25, 0, 32, 8, 2)
    ep1 = episode_prompt_batches(25, 32, 32, 8, 2)
    rank0 = per_replica(ep0, 0) + per_replica(ep1, 0)
    rank1 = per_replica(ep0, 1) + per_replica(ep1, 1)
    assert rank0[:4] == [list(range(8)), list(range(16, 24)), list(range(7, 15)), [23, 24, 0, 1, 2, 3, 4, 5]]
    assert rank1[:3] == [list(range(8, 16)), [24, 0, 1, 2, 3, 4, 5, 6], list(range(15, 23))]


def test_sampler_short_last_batch_and_resume_equivalence():
    b = episode_prompt_batches(100, 0, 10, 4, 1)
    assert [idx for _, idx in b] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # two episodes in a row == one run resumed at consumed_samples=10
    assert episode_prompt_batches(100, 10, 10, 4, 1)[0][1] == [10, 11, 12, 13]


def test_eval_batches_cover_the_set_once():
    b = eval_prompt_batches(7, 3, 2)
    assert b == [(0, [0, 1, 2]), (1, [3, 4, 5]), (0, [6])]


def test_fixed_stream_counts():
    # chatlearn.md 5.3 #5: 16 samples, micro 5 -> 4 micro-batches, last wrapped; global 10 -> 2 iterations
    samples = list(range(16))
    mbs = micro_batches(samples, 5)
    assert mbs == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 0, 1, 2, 3]]
    steps = training_batches(samples, 5, 10)
    assert len(steps) == 2 and steps[0] == mbs[:2] and steps[1] == mbs[2:]


def test_short_step_is_padded_with_its_own_head():
    steps = training_batches(list(range(6)), 2, 8)  # 3 micro-batches, 4 per step
    assert steps == [[[0, 1], [2, 3], [4, 5], [0, 1]]]
    steps = training_batches(list(range(10)), 2, 8)  # second step has only [8, 9]
    assert steps[1] == [[8, 9], [8, 9], [8, 9], [8, 9]]


def test_extra_epochs_reshuffle_deterministically():
    samples = list(range(8))
    steps = training_batches(samples, 4, 8, num_epoch=2, seed=3, episode=1)
    assert len(steps) == 2
    assert steps[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    second = [x for mb in steps[1] for x in mb]
    assert sorted(second) == samples and second != samples
    assert training_batches(samples, 4, 8, num_epoch=2, seed=3, episode=1) == steps
    assert training_batches(samples, 4, 8, num_epoch=2, seed=3, episode=2)[1] != steps[1]


def test_split_and_collate_round_trip_removes_and_restores_padding():
    batch = {
        "prompt_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]),
        "prompt_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        "response_ids": torch.tensor([[11, 2, 0], [12, 13, 2]]),
        "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        "logprobs": torch.tensor([[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]),
        "scores": torch.tensor([0.5, 1.0]),
        "prompt": ["a", "b"],
    }
    samples = split_batch(batch)
    assert samples[0]["prompt_ids"].tolist() == [5, 6]
    assert samples[0]["logprobs"].tolist() == [-1.0, -2.0]
    assert samples[1]["scores"].item() == 1.0 and samples[1]["prompt"] == "b"
    again = collate_samples(samples, pad_token_id=0)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(again[key], value), key
        else:
            assert again[key] == value


def test_load_records_names_file_and_line(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"prompt": "x"}) + "\n\n" + json.dumps({"prompt": "y"}) + "\n")
    assert [r["prompt"] for r in load_records(str(good))] == ["x", "y"]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "x"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"b\.jsonl:2: invalid JSON"):
        load_records([str(good), str(bad)])
    with pytest.raises(DataError, match="not found"):
        load_records(str(tmp_path / "missing.jsonl"))
    arr = tmp_path / "c.json"
    arr.write_text(json.dumps([{"prompt": "z"}]))
    assert load_records(str(arr)) == [{"prompt": "z"}]


def test_missing_prompt_field_names_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: field 'prompt' must be a string, it is missing"):
        load_records(str(f), "prompt")
    g = tmp_path / "q.json"
    g.write_text('[{"prompt": "a"}, {"prompt": 3}]')
    with pytest.raises(DataError, match=r"q\.json: record 1: field 'prompt' must be a string, it is a int"):
        load_records(str(g), "prompt")
    assert len(load_records([str(f)])) == 2  # no key required: both records load


def test_shuffled_stream_is_a_function_of_seed_and_position():
    from chatlearn.data.sampler import stream_index

    ep0 = episode_prompt_batches(10, 0, 10, 4, 1, shuffle_seed=7)
    first_pass = [i for _, idx in ep0 for i in idx]
    assert sorted(first_pass) == list(range(10)) and first_pass != list(range(10))
    # resume at consumed=4 continues exactly where the uninterrupted stream is
    resumed = [i for _, idx in episode_prompt_batches(10, 4, 6, 4, 1, shuffle_seed=7) for i in idx]
    assert resumed == first_pass[4:]
    # the next pass over the data is another permutation; another seed is another order
    second = [stream_index(p, 10, 7) for p in range(10, 20)]
    assert sorted(second) == list(range(10)) and second != first_pass
    assert [stream_index(p, 10, 8) for p in range(10)] != first_pass


def test_every_n_episodes_is_one_rule():
    from chatlearn.runtime.schedule import every

    assert [e for e in range(10) if every(3, e)] == [2, 5, 8]  # after the 3rd, 6th, 9th episode
    assert [e for e in range(4) if every(1, e)] == [0, 1, 2, 3]
    assert not any(every(n, e) for n in (0, None, -1) for e in range(5))  # never
