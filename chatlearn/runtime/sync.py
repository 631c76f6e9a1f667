"""Parameter sync, trainer -> inference copies: the one place weights move between models.

Today's transport is Ray's object store: the trainer's state dict is put once and every actor of the
inference model loads it. Collective groups (gloo/NCCL) are a later transport behind this same call.
"""

from typing import Any

import ray


def copy_weights(src: Any, dsts: list[Any]) -> None:
    """Load the weights of actor `src` into every actor in `dsts`; returns when all have them."""
    weights = src.get_weights.remote()
    ray.get([a.set_weights.remote(weights) for a in dsts])
