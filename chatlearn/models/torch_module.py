"""`TorchModule`: a `BaseModule` that holds PyTorch state, with the pieces every torch model needs.

It pins the thread count to the CPUs Ray granted, seeds torch from the run seed, reports peak memory, and
implements weight export/import for parameter sync and safetensors checkpoints for trainable models.
"""

import resource
from typing import Any

import torch

from chatlearn.checkpoint.model_checkpoint import (
    capture_rng_state,
    load_model_checkpoint,
    restore_rng_state,
    save_model_checkpoint,
)
from chatlearn.models.base_module import BaseModule
from chatlearn.utils.devices import fake_gpus


class TorchModule(BaseModule):
    """Base for modules whose state is a `torch.nn.Module` in `self.model` (and optionally an optimizer)."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None

    @property
    def device(self) -> torch.device:
        on_gpu = torch.cuda.is_available() and self.module_args.num_gpu > 0 and not fake_gpus()
        return torch.device("cuda") if on_gpu else torch.device("cpu")

    def bind(self, module_args, runtime_args, replica_id, seed) -> None:  # type: ignore[override]
        super().bind(module_args, runtime_args, replica_id, seed)
        threads = module_args.cpu_per_process or 1
        torch.set_num_threads(max(1, int(threads)))
        torch.manual_seed(seed)

    # -- parameter sync -------------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The weights to hand to the inference copies (CPU tensors, detached)."""
        assert self.model is not None
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load synced weights; every parameter must be present (a silent partial sync is a bug)."""
        assert self.model is not None
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"{self.name}: sync mismatch, missing={missing[:5]} unexpected={unexpected[:5]}")

    # -- checkpoints ----------------------------------------------------------------------------------------
    scheduler: Any = None

    def save_checkpoint(self, iteration: int) -> str | None:
        """Weights (safetensors), optimizer, LR scheduler and RNG states, checksummed, written atomically."""
        if self.model is None:
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
        """Restore what `save_checkpoint(iteration)` wrote, after verifying its checksums (no unpickling)."""
        assert self.model is not None
        state = load_model_checkpoint(self.checkpoint_dir(iteration), map_location=self.device)
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
