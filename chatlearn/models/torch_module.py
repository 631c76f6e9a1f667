"""`TorchModule`: a `BaseModule` that holds PyTorch state, with the pieces every torch model needs.

It pins the thread count to the CPUs Ray granted, seeds torch from the run seed, reports peak memory, and
implements weight export/import for parameter sync and safetensors checkpoints for trainable models.
"""

import os
import resource
import shutil
from typing import Any

import torch

from chatlearn.models.base_module import BaseModule


class TorchModule(BaseModule):
    """Base for modules whose state is a `torch.nn.Module` in `self.model` (and optionally an optimizer)."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda") if torch.cuda.is_available() and self.module_args.num_gpu > 0 else (
            torch.device("cpu")
        )

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
    def save_checkpoint(self, iteration: int) -> str | None:
        """Weights as safetensors plus optimizer state, written to a temp dir and renamed into place."""
        if self.model is None:
            return None
        from safetensors.torch import save_file

        final = self.checkpoint_dir(iteration)
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, os.path.join(tmp, "model.safetensors"))
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def load_checkpoint(self, iteration: int) -> None:
        """Load what `save_checkpoint` wrote; `weights_only=True` so nothing arbitrary is unpickled."""
        from safetensors.torch import load_file

        path = self.checkpoint_dir(iteration)
        assert self.model is not None
        self.model.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
        opt_path = os.path.join(path, "optimizer.pt")
        if self.optimizer is not None and os.path.exists(opt_path):
            self.optimizer.load_state_dict(torch.load(opt_path, weights_only=True))

    def peak_memory(self) -> float:
        if torch.cuda.is_available() and self.module_args.num_gpu > 0:
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) if self.model is not None else 0

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "replica": self.replica_id, "params": self.num_parameters()}
