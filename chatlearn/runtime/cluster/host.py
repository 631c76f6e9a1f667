"""The host of one rank of one model inside a worker process (the Ray actor is the `Worker`, which may host
several colocated models), and the data-plane rules it follows.

A batch it makes (`generate`, `forward`) is returned as is: the worker returns it as an object of its own
that the driver owns (`Worker.run_batch`), so it outlives this process and stays where it was made until a
later call reads it. Inputs may arrive as values (Ray resolves top-level refs) or as refs nested one level
(the refs that earlier calls returned), and several inputs for the same samples are merged into one dict, as
ChatLearn merges the outputs of a node's parents.
"""

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
import torch

from chatlearn.config import ModelConfig, RuntimeConfig
from chatlearn.data.batch import collate_samples, merge_batches
from chatlearn.data.staleness import drop_stale
from chatlearn.data.stream import training_batches
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.calls.waiting import fetch

F = TypeVar("F", bound=Callable[..., Any])


_DEFAULT_RESIDENT = ("weights",)


def resident(*parts: str) -> Callable[[F], F]:
    """Declare what a host method needs in memory while it runs (``"weights"``, ``"optimizer"``): before it runs,
    the colocated models of the process offload and this one onloads that (`chatlearn.runtime.cluster.worker`).
    ``@resident()``: the method touches no tensors, no handover around it. Undeclared: the weights."""

    def mark(fn: F) -> F:
        fn.resident = parts  # type: ignore[attr-defined]
        return fn

    return mark


def resident_parts(method: str) -> tuple[str, ...]:
    """What `ModelHost.<method>` needs resident (see `resident`)."""
    return getattr(getattr(ModelHost, method, None), "resident", _DEFAULT_RESIDENT)


class ModelHost:
    """Wraps a `BaseModule`: setup, batched forward/eval/train calls, sync and checkpoint hooks."""

    def __init__(self, module: BaseModule, module_args: ModelConfig, runtime_args: RuntimeConfig, replica_id: int):
        self.module = module
        self.module.bind(module_args, runtime_args, replica_id, runtime_args.seed)
        self.runtime_args = runtime_args
        self.datasets: dict[bool, Any] = {}
        self.pad_token_id = 0

    def setup(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.module.setup()
        tok = getattr(self.module, "tokenizer", None)
        if tok is not None and tok.pad_token_id is not None:
            self.pad_token_id = int(tok.pad_token_id)
        ctx = ray.get_runtime_context()
        info = {"pid": os.getpid(), "node": ctx.get_node_id(), "gpu_ids": ray.get_gpu_ids(),
                "resources": ctx.get_assigned_resources(), "setup_seconds": time.perf_counter() - t0,
                "pad_token_id": self.pad_token_id}
        if hasattr(self.module, "info"):
            info.update(self.module.info())
        return info

    @resident()
    def ping(self) -> bool:
        return True

    # -- data producer --------------------------------------------------------------------------------------
    @resident()
    def build_dataset(self, prompts: list[Any], is_eval: bool = False) -> int:
        self.datasets[is_eval] = self.module.build_dataset(prompts, is_eval)
        return len(self.datasets[is_eval])

    def generate(self, indices: list[int], iteration: int, is_eval: bool = False,
                 sample_ids: list[int] | None = None, group_size: int = 1,
                 flow_method: str = "forward_step", policy_version: int | None = None,
                 continued: Any = None, max_new_tokens: int | None = None) -> Any:
        """Collate dataset items `indices` and run the flow's method on them (`run_method`).

        `sample_ids` (the samples' positions in the response stream) go into dict batches as `sample_id`, so a
        module can seed per sample instead of per batch. With `group_size` > 1 (several responses per prompt)
        the batch also gets `group_id` (`sample_id // group_size`): the responses to one prompt share it. With
        `policy_version` (pipelined episodes, partial rollouts) every response is stamped with the weights
        version it came from, and every response token with its own (`token_versions`).

        A round of a partial rollout (`max_new_tokens`, the round's budget, as the batch's
        `max_generate_token_length`): new prompts from `indices`, or `continued`, the samples of responses begun
        in earlier rounds (their prompts, tokens, log-probs and versions so far), which the module goes on with.
        """
        if continued is not None:
            batch = collate_samples(fetch(continued, self.runtime_args.stage_timeout_s), self.pad_token_id)
        else:
            dataset = self.datasets[is_eval]
            batch = self.module.collate_fn([dataset[i] for i in indices])
            if isinstance(batch, dict):
                batch["sample_id"] = list(sample_ids if sample_ids is not None else indices)
                if group_size > 1:
                    batch["group_id"] = [sid // group_size for sid in batch["sample_id"]]
        if max_new_tokens is not None:
            batch["max_generate_token_length"] = [max_new_tokens] * len(batch["sample_id"])
        out = self.run_method(flow_method, batch, iteration, is_eval)
        if policy_version is not None and isinstance(out, dict):  # the weights it was generated on
            out["policy_version"] = [policy_version] * len(batch["sample_id"])
        if policy_version is not None and isinstance(out, dict) and "response_ids" in out:
            versions = torch.full(out["response_ids"].shape, policy_version, dtype=torch.long)
            if continued is not None:  # the earlier rounds' tokens keep their own versions
                for i, n in enumerate(batch["response_mask"].sum(-1).long().tolist()):
                    versions[i, :n] = batch["token_versions"][i, :n]
            out["token_versions"] = versions * out["response_mask"].long()
        return out

    def run_method(self, method: str, data: Any, iteration: int, is_eval: bool) -> Any:
        """The module method a compute flow calls: ``forward_step(data, iteration)`` (in an evaluator flow,
        ``eval_step(data)``, as ChatLearn runs eval), ``eval_step``/``eval_forward``/``score_step(data)``."""
        if method == "forward_step":
            return self.module.eval_step(data) if is_eval else self.module.forward_step(data, iteration)
        if method not in ("eval_step", "eval_forward", "score_step"):
            raise AttributeError(f"{self.module.name}: {method} is not a method a compute flow calls")
        return getattr(self.module, method)(data)

    # -- inference on upstream outputs ----------------------------------------------------------------------
    def forward(self, *inputs: Any, iteration: int = 0, is_eval: bool = False, keep_inputs: bool = False,
                flow_method: str = "forward_step") -> Any:
        """Run the flow's method on the merged inputs; with `keep_inputs` the output carries them."""
        data = merge_batches(*[fetch(x, self.runtime_args.stage_timeout_s) for x in inputs])
        out = self.run_method(flow_method, data, iteration, is_eval)
        return merge_batches(data, out) if keep_inputs else out

    # -- training -------------------------------------------------------------------------------------------
    @resident("weights", "optimizer")
    def train(self, samples: list[dict[str, Any]], episode: int, start_iteration: int,
              group_size: int = 1) -> dict[str, Any]:
        """Train on one episode's samples: re-batch, one `train_step` per global batch, for each epoch.

        Returns the mean of each metric over the steps and the trainer iteration reached.
        """
        samples = fetch(samples, self.runtime_args.stage_timeout_s)
        rt = self.runtime_args
        sample_stats: dict[str, float] = {}  # of the episode's samples, before training
        if rt.max_staleness > 0 or rt.use_partial_rollout:  # the trainer is at version `episode` (one per episode)
            # a partial rollout's response may end, or wait for its group, up to max_rollout_round - 1 rounds later
            bound = rt.max_staleness + (rt.partial_rollout_manager_config.max_rollout_round - 1
                                        if rt.use_partial_rollout else 0)
            samples, sample_stats = drop_stale(samples, episode, bound, group_size)
        if hasattr(self.module, "episode_stats"):  # what a trainer reports of the samples themselves
            sample_stats.update(self.module.episode_stats(samples))
        steps = training_batches(samples, rt.train_micro_batch_size, rt.train_global_batch_size,
                                 rt.num_training_epoch, seed=self.module.seed, episode=episode,
                                 group_size=group_size)
        iteration = start_iteration
        sums: dict[str, float] = {}
        for step in steps:
            data_list = [collate_samples(mb, self.pad_token_id) for mb in step]
            metrics = self.module.train_step(data_list, iteration) or {}
            iteration += 1
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        result: dict[str, Any] = {k: v / max(1, len(steps)) for k, v in sums.items()}
        result.update(iteration=iteration, num_steps=len(steps), num_samples=len(samples), **sample_stats)
        return result

    # -- sync / checkpoint / hooks --------------------------------------------------------------------------
    def get_weights(self) -> Any:
        return self.module.get_weights()

    def set_weights(self, weights: Any) -> bool:
        self.module.set_weights(fetch(weights, self.runtime_args.stage_timeout_s))
        self.module.weights_synced()
        return True

    @resident("weights", "optimizer")
    def save_checkpoint(self, iteration: int) -> str | None:
        return self.module.save_checkpoint(iteration)

    @resident("weights", "optimizer")
    def load_checkpoint(self, iteration: int) -> None:
        self.module.load_checkpoint(iteration)

    # ChatLearn's episode hooks; no memory handover around them: a colocated model's offloaded parts stay put
    @resident()
    def before_episode(self) -> None:
        self.module.before_episode()

    @resident()
    def after_episode(self) -> None:
        self.module.after_episode()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call any other public method of the module (e.g. `export_hf`, `info`)."""
        if method.startswith("_"):
            raise AttributeError(f"refusing to call private method {method!r}")
        return getattr(self.module, method)(*[fetch(a, self.runtime_args.stage_timeout_s) for a in args], **kwargs)

    @resident()
    def peak_memory(self) -> float:
        return self.module.peak_memory()

