"""From one episode's samples to the trainer's global batches: ChatLearn's `fixed` stream semantics.

The episode's `total` samples are cut into `ceil(total / micro)` micro-batches, the short last one padded by
wrapping to the start of the buffer; the trainer runs `ceil(total / global)` iterations per epoch, each over
`global // micro` micro-batches, a short last list padded by repeating its own head. Epochs after the first
reshuffle the samples with a generator seeded by (seed, episode, epoch), so the order is reproducible.
"""

import math
import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def micro_batches(samples: Sequence[T], micro: int) -> list[list[T]]:
    n = len(samples)
    if n == 0:
        return []
    out = []
    for start in range(0, math.ceil(n / micro) * micro, micro):
        out.append([samples[(start + k) % n] for k in range(micro)])
    return out


def training_batches(
    samples: Sequence[T], micro: int, global_batch: int, num_epoch: int = 1, seed: int = 0, episode: int = 0
) -> list[list[list[T]]]:
    """A list of iterations; each iteration is the list of micro-batches of one optimizer step."""
    per_step = global_batch // micro
    iterations: list[list[list[T]]] = []
    for epoch in range(num_epoch):
        order = list(samples)
        if epoch > 0:
            random.Random(f"{seed}-{episode}-{epoch}").shuffle(order)
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
