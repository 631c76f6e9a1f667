"""From one episode's samples to the trainer's global batches: ChatLearn's `fixed` stream semantics.

The episode's `total` samples are cut into `ceil(total / micro)` micro-batches, the short last one padded by
wrapping to the start of the buffer; the trainer runs `ceil(total / global)` iterations per epoch, each over
`global // micro` micro-batches, a short last list padded by repeating its own head. Epochs after the first
reshuffle the samples with a generator seeded by (seed, episode, epoch), so the order is reproducible.

Which samples an episode trains on is `runtime.stream_data_loader_type` (`select_episode_samples`): "fixed"
trains on exactly `sample_per_episode` samples, "dynamic" on everything the episode produced (reward functions
that emit a variable number of samples per prompt). With relay on (`runtime.max_relay_episode != 0` and the
episode at or past `relay_episode_offset`, see `chatlearn.data.relay`) the training set is the relay hook's
output, whatever the loader type, as in ChatLearn: the loader type only applies to stream-mode episodes.
"""

import math
import random
from collections.abc import Sequence
from typing import TypeVar

from chatlearn.data.relay import RelayBuffer

T = TypeVar("T")


STREAM_LOADER_TYPES = ("fixed", "dynamic")


def select_episode_samples(samples: list, loader_type: str, sample_per_episode: int) -> list:
    """The samples a stream-mode episode trains on; "fixed" must not silently train on a partial episode."""
    kind = str(loader_type).lower()
    if kind == "fixed":
        if len(samples) < sample_per_episode:
            raise ValueError(
                f"runtime.stream_data_loader_type='fixed' needs sample_per_episode={sample_per_episode} samples "
                f"but the episode produced only {len(samples)}; ChatLearn's fixed loader would wait forever for "
                f"the rest. Use stream_data_loader_type='dynamic' if rewards emit a variable number of samples."
            )
        return list(samples[:sample_per_episode])
    if kind == "dynamic":
        return list(samples)
    raise ValueError(
        f"unknown runtime.stream_data_loader_type {loader_type!r}; expected one of {list(STREAM_LOADER_TYPES)}"
    )


def episode_training_samples(produced: list[dict], episode: int, relay: RelayBuffer, loader_type: str,
                             sample_per_episode: int) -> tuple[list[dict], list[dict]]:
    """(the episode's own samples, what the trainers train on) for one episode.

    Relay on for this episode: the relay buffer takes *every* produced sample, whatever the loader type (as
    ChatLearn's relay branch drains the whole episode), and the hook's output is the training set. Otherwise
    the loader type cuts the produced samples (`select_episode_samples`).
    """
    if relay.takes(episode):
        return list(produced), relay.add_episode(episode, produced) or []
    own = select_episode_samples(produced, loader_type, sample_per_episode)
    return own, own


def micro_batches(samples: Sequence[T], micro: int) -> list[list[T]]:
    """Fixed-size micro-batches; the short last one wraps to the buffer's start (ChatLearn pads by wrapping)."""
    n = len(samples)
    if n == 0:
        return []
    out = []
    for start in range(0, math.ceil(n / micro) * micro, micro):
        out.append([samples[(start + k) % n] for k in range(micro)])
    return out


def group_blocks(samples: Sequence[T], group_size: int) -> list[list[T]]:
    """The samples cut into their prompts' groups: runs of consecutive samples with one ``group_id`` where they
    carry one (a group trained in parts, ``mini_response_per_prompt``, is a shorter run), else blocks of
    ``group_size``. Where every group is whole and in order, the two agree."""
    if group_size > 1 and samples and all(isinstance(s, dict) and "group_id" in s for s in samples):
        blocks: list[list[T]] = []
        for s in samples:
            if blocks and blocks[-1][0]["group_id"] == s["group_id"]:  # type: ignore[index]
                blocks[-1].append(s)
            else:
                blocks.append([s])
        return blocks
    size = max(1, group_size)
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


def training_batches(
    samples: Sequence[T], micro: int, global_batch: int, num_epoch: int = 1, seed: int = 0, episode: int = 0,
    group_size: int = 1,
) -> list[list[list[T]]]:
    """A list of iterations; each iteration is the list of micro-batches of one optimizer step.

    With `group_size` > 1 the reshuffle of later epochs moves whole groups (`group_blocks`: a prompt's responses
    stay together, as online DPO's pairs need); 1 shuffles samples, as before.
    """
    per_step = global_batch // micro
    iterations: list[list[list[T]]] = []
    for epoch in range(num_epoch):
        order = list(samples)
        if epoch > 0:
            blocks = group_blocks(order, group_size)
            random.Random(f"{seed}-{episode}-{epoch}").shuffle(blocks)
            order = [s for b in blocks for s in b]
        mbs = micro_batches(order, micro)
        num_iter = math.ceil(len(order) / global_batch)
        for it in range(num_iter):
            chunk = mbs[it * per_step : (it + 1) * per_step]
            if not chunk:
                break
            head = len(chunk)
            while len(chunk) < per_step:
                chunk.append(chunk[len(chunk) % head])
            iterations.append(chunk)
    return iterations
