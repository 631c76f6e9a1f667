"""Which prompts each episode generates from, ChatLearn's `EpisodeDataSampler` rules, as pure functions.

The stream of prompt indices starts at `consumed_samples` and wraps around the dataset forever. It is cut
into global batches of `generation_batch_size * num_replica` indices (the last batch of an episode is short
when `sample_per_episode` is not a multiple), and each global batch is split near-evenly across the policy
replicas, earlier replicas taking the extra item. Everything is a function of (dataset size,
`consumed_samples`), so a resumed run sees exactly the prompts the uninterrupted run would have.
"""

import functools
import random


def split_index(length: int, num_splits: int) -> list[tuple[int, int]]:
    """Near-equal contiguous [start, end) ranges; e.g. 10 into 3 -> (0,4), (4,7), (7,10)."""
    base, extra = divmod(length, num_splits)
    out, start = [], 0
    for i in range(num_splits):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


@functools.lru_cache(maxsize=4)
def _epoch_permutation(dataset_size: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(dataset_size))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return tuple(order)


def stream_index(position: int, dataset_size: int, shuffle_seed: int | None = None) -> int:
    """Dataset index at a stream position: in file order, or shuffled once per pass over the data (seeded)."""
    if shuffle_seed is None:
        return position % dataset_size
    return _epoch_permutation(dataset_size, shuffle_seed, position // dataset_size)[position % dataset_size]


def episode_prompt_batches(
    dataset_size: int, consumed_samples: int, sample_per_episode: int, batch_size: int, num_replica: int,
    shuffle_seed: int | None = None,
) -> list[tuple[int, list[int]]]:
    """(replica, prompt indices) for every generation batch of one episode, in dispatch order.

    `shuffle_seed` (ChatLearn v1.0.3's `data_shuffle`) permutes each pass over the dataset with a generator
    seeded by (seed, pass), so the order is still a pure function of (seed, consumed_samples).
    """
    if dataset_size <= 0:
        raise ValueError("the prompt dataset is empty")
    out: list[tuple[int, list[int]]] = []
    produced = 0
    position = consumed_samples
    while produced < sample_per_episode:
        n = min(batch_size * num_replica, sample_per_episode - produced)
        global_batch = [stream_index(position + k, dataset_size, shuffle_seed) for k in range(n)]
        position += n
        produced += n
        for replica, (start, end) in enumerate(split_index(n, num_replica)):
            if end > start:
                out.append((replica, global_batch[start:end]))
    return out


def episode_generation_batches(
    dataset_size: int, consumed_samples: int, sample_per_episode: int, batch_size: int, num_replica: int,
    shuffle_seed: int | None = None, group_size: int = 1,
) -> list[tuple[int, list[int], list[int]]]:
    """(replica, dataset indices, sample ids) for every generation batch of one episode.

    Counts are in samples (responses), as ChatLearn's ``sample_per_episode``. With ``group_size`` n > 1
    (``num_inference_per_prompt``) each prompt is repeated n times in a row and the prompt stream advances by
    ``sample_per_episode / n`` prompts; batches of ``batch_size / n`` prompts are dealt over the replicas, so a
    prompt's group is never split across batches or replicas (ChatLearn's ``data_rerank``). A sample's id is
    its position in the response stream and ``id // n`` is its group. n = 1 is exactly
    :func:`episode_prompt_batches`.
    """
    n = group_size
    prompt_batches = episode_prompt_batches(dataset_size, consumed_samples // n, sample_per_episode // n,
                                            max(1, batch_size // n), num_replica, shuffle_seed)
    out, position = [], consumed_samples
    for replica, idx in prompt_batches:
        indices = [i for i in idx for _ in range(n)]
        out.append((replica, indices, list(range(position, position + len(indices)))))
        position += len(indices)
    return out


def eval_prompt_batches(dataset_size: int, batch_size: int, num_replica: int) -> list[tuple[int, list[int]]]:
    """The whole eval set once, no wrap-around, batches dealt round-robin over the replicas."""
    batches = [list(range(s, min(s + batch_size, dataset_size))) for s in range(0, dataset_size, batch_size)]
    return [(i % num_replica, b) for i, b in enumerate(batches)]
