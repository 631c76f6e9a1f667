"""The run's StreamDataset actor: turns an episode's experience into the trainers' sample list.

As in ChatLearn, one actor per run sits between the environment and the trainers. It merges the experience
batches into per-sample dicts and hands every trainer the same list by ObjectRef (a return value the driver
owns, as every batch of an episode: `chatlearn.runtime.calls.handles`): in stream mode the
episode's samples cut by `stream_data_loader_type` (`fixed`: exactly `sample_per_episode`; `dynamic`: all
that were produced); with relay on (`max_relay_episode`, from `relay_episode_offset`) the relay hook's output,
the relay buffer having taken *every* sample the episode produced, whatever the loader type (ChatLearn's
relay branch drains the whole episode). It holds the relay window, so it also
saves and restores it for data checkpoints. It asks Ray for no CPU: it only reshapes data.
"""

from typing import Any

import ray

from chatlearn.config import RuntimeConfig
from chatlearn.data.batch import merge_batches, split_batch
from chatlearn.data.dynamic_sampling import informative_groups, keep_informative
from chatlearn.data.relay import RelayBuffer, load_hook
from chatlearn.data.stream import episode_training_samples
from chatlearn.runtime.calls.waiting import fetch
from chatlearn.runtime.records.traces import trace_rows
from chatlearn.utils.wire import packed


def experience_stats(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Episode-level numbers every RL run wants to see, from whatever the experience carries."""
    stats: dict[str, float] = {}
    if not samples:
        return stats
    if "scores" in samples[0]:
        stats["reward_mean"] = sum(float(s["scores"]) for s in samples) / len(samples)
    named = sorted(k for k in samples[0] if k.startswith("rewards/"))
    if len(named) > 1:  # several rewards combined: each one's mean under its model name
        for key in named:
            stats[f"{key}_mean"] = sum(float(s[key]) for s in samples) / len(samples)
    if "overlong_penalty" in samples[0]:  # DAPO's overlong shaping, part of reward_mean
        stats["overlong_penalty_mean"] = sum(float(s["overlong_penalty"]) for s in samples) / len(samples)
    if "kl" in samples[0]:
        stats["kl_mean"] = sum(float(s["kl"].sum()) for s in samples) / len(samples)
    if "response_mask" in samples[0]:
        stats["response_length_mean"] = sum(float(s["response_mask"].sum()) for s in samples) / len(samples)
    return stats


class StreamDataset:
    def __init__(self, runtime_args: RuntimeConfig):
        self.rt = runtime_args
        hook = runtime_args.relay_sample_fn
        self.relay = RelayBuffer(runtime_args.max_relay_episode, runtime_args.relay_episode_offset,
                                 load_hook(hook) if hook else None)

    @ray.method(num_returns=3)
    def episode_samples(self, batches: list[list[Any]], episode: int
                        ) -> tuple[dict[str, Any], packed, list[dict[str, Any]]]:
        """The episode's experience stats, its training samples and its trace rows (every sample it generated,
        `runtime.trace_samples`), as three return values: the caller (the driver) waits for the stats and the
        rows, and owns the samples, which only the trainers fetch. ``batches`` holds each batch's parts (the
        outputs of the environment flow's returned calls, merged)."""
        produced = self._samples(batches)
        generated = produced
        filtered = {}
        if self.rt.dynamic_sampling:  # every response generated is reported; the informative groups train
            every = experience_stats(produced)
            produced, dropped = keep_informative(produced, self.rt.sample_per_episode)
            filtered = {**every, "filtered_groups": dropped}
        own, samples = episode_training_samples(produced, episode, self.relay, self.rt.stream_data_loader_type,
                                                self.rt.sample_per_episode)
        stats = experience_stats(own)
        stats.update(filtered)
        stats.update(num_samples=len(samples), relay_episodes=len(self.relay.episodes))
        rows = trace_rows(generated, (s.get("sample_id", -1) for s in samples), episode, self.rt.trace_samples,
                          self.rt.seed)
        return stats, packed(samples), rows  # tensors as arrays: each trainer's get is cheap

    def informative_samples(self, batches: list[list[Any]]) -> int:
        """Dynamic sampling: how many samples of these scored batches are in groups the reward tells apart."""
        return sum(len(g) for g in informative_groups(self._samples(batches))[0])

    def _samples(self, batches: list[list[Any]]) -> list[dict[str, Any]]:
        """The samples of ``batches``, each batch's parts fetched and merged."""
        timeout = self.rt.stage_timeout_s
        return [s for parts in batches for s in split_batch(merge_batches(*[fetch(p, timeout) for p in parts]))]

    def save_relay(self, directory: str) -> str | None:
        if not self.relay.enabled:
            return None
        self.relay.save(directory)
        return directory

    def load_relay(self, directory: str) -> list[int]:
        self.relay.load(directory)
        return self.relay.episodes
