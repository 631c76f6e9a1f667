"""`TorchModule`: a `BaseModule` that holds PyTorch state, with the pieces every torch model needs.

It pins the thread count to the CPUs Ray granted, bounds oneDNN's per-shape kernel caches, seeds torch from the
run seed, reports peak memory, and implements weight export/import for parameter sync and safetensors
checkpoints for trainable models.
"""

import resource
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from chatlearn.checkpoint.dist_checkpoint import is_sharded_checkpoint, load_sharded, save_sharded
from chatlearn.checkpoint.model_checkpoint import (
    capture_rng_state,
    load_model_checkpoint,
    restore_rng_state,
    save_model_checkpoint,
)
from chatlearn.models.base_module import BaseModule
from chatlearn.models.parallel import clip_grad_norm, full_tensors, load_full_tensor, parallelize
from chatlearn.models.pipeline import PipelinedLM, gather_stages
from chatlearn.models.precision import bound_kernel_caches
from chatlearn.utils.devices import fake_gpus
from chatlearn.utils.finite import require_finite


class TorchModule(BaseModule):
    """Base for modules whose state is a `torch.nn.Module` in `self.model` (and optionally an optimizer)."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    # what train steps call: a DDP wrapper of `model` under plain data parallel, else `model` itself
    train_model: torch.nn.Module | None = None
    # whether weights can sync over collective groups (`sync_sources`/`sync_targets`); a subclass that
    # overrides get_weights/set_weights without those syncs through the object store, by its own methods
    collective_sync: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if ("get_weights" in cls.__dict__ and "sync_sources" not in cls.__dict__) or (
                "set_weights" in cls.__dict__ and "sync_targets" not in cls.__dict__):
            cls.collective_sync = False

    @property
    def device(self) -> torch.device:
        on_gpu = torch.cuda.is_available() and self.module_args.num_gpu > 0 and not fake_gpus()
        return torch.device("cuda") if on_gpu else torch.device("cpu")

    def bind(self, module_args, runtime_args, replica_id, seed) -> None:  # type: ignore[override]
        super().bind(module_args, runtime_args, replica_id, seed)
        bound_kernel_caches()  # before the process's first kernel: bf16 shapes would otherwise pile up
        threads = module_args.cpu_per_process or 1
        torch.set_num_threads(max(1, int(threads)))
        torch.manual_seed(seed)

    # -- parallel layouts -----------------------------------------------------------------------------------
    def parallelize(self) -> None:
        """Apply the replica's layout (data parallel, ZeRO, tensor parallel) to ``self.model``; call it in
        ``setup`` before building the optimizer. A replica of one process is left as it is."""
        assert self.model is not None
        self.train_model = parallelize(self.model, self.parallel, self.trainable)

    @property
    def fwd(self) -> torch.nn.Module:
        """The module to run in a train step's forward pass (the DDP wrapper when there is one)."""
        assert self.model is not None
        return self.train_model if self.train_model is not None else self.model

    @property
    def pipelined(self) -> bool:
        """Whether the replica is split into pipeline stages (each process trains its own layers)."""
        return self.parallel is not None and self.parallel.dims.pp > 1

    @property
    def sharded(self) -> bool:
        """Whether this rank's weights are not the whole model's by themselves (FSDP2, tensor or pipeline
        parallel): checkpoints are then written sharded."""
        return self.parallel is not None and (
            self.pipelined or any(isinstance(v, DTensor) for v in self.model.state_dict().values()))

    @property
    def infer_model(self) -> Any:
        """What inference calls like the model (``input_ids``, ``attention_mask``, ``position_ids`` →
        ``.logits``): the model, or the pipeline of stages."""
        return PipelinedLM(self.model, self.parallel) if self.pipelined else self.model

    def gather_stages(self) -> None:
        """Pipeline parallel: make this process's copy of every stage's weights current (a collective of the
        stages); called before the weights leave (sync, export, checkpoint)."""
        if self.pipelined:
            gather_stages(self.model, self.parallel, self.parallel.owned)

    def data_shard(self, data_list: list[Any]):
        """This rank's micro-batches of a global batch as ``(micro_batch, on)`` (see ``ParallelContext``)."""
        if self.parallel is None:
            return ((mb, 1.0) for mb in data_list)
        return self.parallel.data_shard(self.fwd, data_list)

    def sum_stats(self, stats: dict[str, float], keys: list[str] | tuple[str, ...]) -> dict[str, float]:
        """Statistics accumulated over this rank's micro-batches, summed over the data-parallel ranks."""
        return stats if self.parallel is None else self.parallel.sum_stats(stats, keys)

    def clip_gradients(self, max_norm: float) -> float:
        """Finish the gradients (sum over data-parallel ranks where the wrapper did not) and clip them.

        A gradient norm that is not finite is a RunError here, before any optimizer can step on it (clipping
        by a NaN norm makes every gradient NaN, and the step every weight). The norm is the replica's global
        one, the same on all its ranks, so they all stop together."""
        assert self.model is not None
        if self.parallel is None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        else:
            ctx = self.parallel
            ctx.finish_grads(self.model)
            pp_group = ctx.dim_groups.get("pp") if self.pipelined else None
            # a weight several stages use (tied embeddings) has its whole gradient on each: its owner counts it
            mine = ctx.owned.get(ctx.coords["pp"], set())
            elsewhere = [p for n, p in self.model.named_parameters() if n in ctx.shared and n not in mine]
            norm = clip_grad_norm([p for p in self.model.parameters() if p.requires_grad], max_norm, pp_group,
                                  elsewhere)
        require_finite(norm, f"{self.name}: gradient norm", "; the optimizer step was not taken")
        return norm

    # -- parameter sync -------------------------------------------------------------------------------------
    def sync_sources(self) -> dict[str, torch.Tensor]:
        """The weights a collective sync sends, by name (DTensors are gathered tensor by tensor by the sync)."""
        assert self.model is not None
        return dict(self.model.state_dict())

    def sync_targets(self) -> dict[str, torch.Tensor]:
        """The tensors a collective sync writes into, in place, by name (DTensors get their local slice)."""
        assert self.model is not None
        return dict(self.model.state_dict())

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The weights to hand to the inference copies (whole CPU tensors, detached; gathered from shards on
        every rank of a sharded replica; tied names one tensor)."""
        assert self.model is not None
        self.gather_stages()
        return full_tensors(self.sync_sources(), "cpu")

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load synced weights; every parameter must be present (a silent partial sync is a bug)."""
        assert self.model is not None
        if self.sharded:
            targets = self.sync_targets()
            missing = [k for k in targets if k not in weights]
            unexpected = [k for k in weights if k not in targets]
            if not missing and not unexpected:
                with torch.no_grad():
                    for k, t in targets.items():
                        load_full_tensor(t, weights[k])
                return
        else:
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"{self.name}: sync mismatch, missing={missing[:5]} unexpected={unexpected[:5]}")

    # -- checkpoints ----------------------------------------------------------------------------------------
    scheduler: Any = None

    def save_checkpoint(self, iteration: int) -> str | None:
        """Weights (safetensors), optimizer, LR scheduler and RNG states, checksummed, written atomically.

        A sharded replica writes a torch distributed checkpoint (every rank its shards); a data-parallel
        replica's rank 0 writes the usual one (the other ranks hold the same state)."""
        if self.model is None:
            return None
        if self.sharded:
            self.gather_stages()
            return save_sharded(self.checkpoint_dir(iteration), self.model, self.optimizer, self.scheduler,
                                self.process_group, meta={"model": self.name, "iteration": iteration})
        if self.rank != 0:
            return None
        return save_model_checkpoint(
            self.checkpoint_dir(iteration),
            self.model.state_dict(),
            optimizer=self.optimizer.state_dict() if self.optimizer is not None else None,
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
            rng=capture_rng_state(),
            meta={"model": self.name, "iteration": iteration},
        )

    def load_checkpoint(self, iteration: int) -> None:
        """Restore what `save_checkpoint(iteration)` wrote, after verifying its checksums (no unpickling).

        A sharded checkpoint loads into any layout (another world size, or one process)."""
        assert self.model is not None
        path = self.checkpoint_dir(iteration)
        if is_sharded_checkpoint(path):
            load_sharded(path, self.model, self.optimizer, self.scheduler, self.process_group)
            return
        state = load_model_checkpoint(path, map_location=self.device)
        if self.sharded:
            self.set_weights(state["weights"])
            if self.optimizer is not None and state["optimizer"] is not None:
                raise RuntimeError(f"{path}: a single-process checkpoint's optimizer state cannot load into the "
                                   f"sharded {self.name} (resume with the layout that wrote it)")
        else:
            self.model.load_state_dict(state["weights"], strict=True)
            if self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["rng"] is not None:
            restore_rng_state(state["rng"])

    def peak_memory(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) if self.model is not None else 0

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "replica": self.replica_id, "params": self.num_parameters()}
