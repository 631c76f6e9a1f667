"""Parameter sync, trainer -> inference copies: the one place weights move between models.

Two transports behind one call. A receiver in the trainer's own worker process (colocated on its device) gets
an in-process copy; any other receiver gets the trainer's state dict through Ray's object store, put once and
loaded by every such receiver. Collective groups (gloo/NCCL) are a later transport behind this same call.
"""

import ray

from chatlearn.runtime.handles import ModelHandle


def copy_weights(src: ModelHandle, dsts: list[ModelHandle]) -> None:
    """Load the weights of model rank `src` into every rank in `dsts`; returns when all have them."""
    local = [d for d in dsts if d.process == src.process]
    remote = [d for d in dsts if d.process != src.process]
    calls = [d.actor.copy_local.remote(d.model, src.model) for d in local]
    if remote:
        weights = src.get_weights.remote()
        calls += [d.set_weights.remote(weights) for d in remote]
    ray.get(calls)
