"""Offload and re-materialise one torch model's memory between stages: ChatLearn's memory manager.

ChatLearn colocates several models in one worker process per device. Between stages a model gives back what it
does not need (``free_grad_buffers``, ``offload_optimizer_states``, ``offload_weights``; ``free_memory`` switches
all three on) so that the other model on the device has the memory, and takes it back before its next stage.
Host staging buffers are flat per-dtype tensors of at most ``bucket_size_mb_in_memory_manager`` MiB each.

The same code runs on CPU as on a GPU, on purpose: on CPU there is no separate device memory, so the "host" buffer
is just another CPU tensor, but the copy out, the storage release (``untyped_storage().nbytes() == 0``) and the
copy back are real. That makes the release path testable without a GPU, and a run with offload/onload cycles
must end bit-identical to one without.

Object identity is kept throughout: the optimizer holds the ``Parameter`` objects and its state dict holds the
state tensors, so only ``.data`` is swapped, never the objects.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch

PARTS = ("grads", "optimizer", "weights")  # ChatLearn's offload order

_MIB = 1024 * 1024


@dataclass
class _Entry:
    """Where one released tensor lives in the staging buffers and what it looked like before."""

    tensor: torch.Tensor  # the very object whose .data was swapped (a Parameter or an optimizer state tensor)
    bucket: int
    offset: int
    numel: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    memory_format: torch.memory_format


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    """The layout to restore ``t`` with (``zeros_like`` optimizer states follow their parameter's layout)."""
    if t.is_contiguous():
        return torch.contiguous_format
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


class _Staging:
    """Host copies of a set of tensors, packed into flat per-dtype buckets of bounded size."""

    def __init__(self) -> None:
        self.buckets: list[torch.Tensor] = []
        self.entries: list[_Entry] = []

    @classmethod
    def release(cls, tensors: list[torch.Tensor], bucket_bytes: int, pin: bool) -> "_Staging":
        """Copy ``tensors`` into new host buckets, then release their storage (``.data`` becomes empty)."""
        staging = cls()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        plans: list[tuple[torch.dtype, list[torch.Tensor]]] = []
        for dtype, group in by_dtype.items():
            cap = max(1, bucket_bytes // torch.empty(0, dtype=dtype).element_size())  # in elements
            current: list[torch.Tensor] = []
            used = 0
            for t in group:
                n = t.numel()
                if current and used + n > cap:
                    plans.append((dtype, current))
                    current, used = [], 0
                current.append(t)  # a tensor larger than a bucket gets a bucket of its own size
                used += n
            if current:
                plans.append((dtype, current))

        with torch.no_grad():
            for dtype, members in plans:
                total = sum(t.numel() for t in members)
                buf = torch.empty(total, dtype=dtype, device="cpu", pin_memory=pin)
                offset = 0
                for t in members:
                    n = t.numel()
                    buf[offset:offset + n].view(t.shape).copy_(t.detach(), non_blocking=pin)
                    staging.entries.append(_Entry(t, len(staging.buckets), offset, n, t.shape, t.dtype, t.device,
                                                  _memory_format(t)))
                    offset += n
                staging.buckets.append(buf)
            if pin:
                torch.cuda.synchronize()  # the host copies must be complete before the device storage goes
            for e in staging.entries:
                e.tensor.data = torch.empty(0, dtype=e.dtype, device=e.device)
        return staging

    def restore(self, pin: bool) -> None:
        """Give every tensor fresh storage of its original shape, dtype, device and layout, filled from the host."""
        with torch.no_grad():
            for e in self.entries:
                fresh = torch.empty(e.shape, dtype=e.dtype, device=e.device, memory_format=e.memory_format)
                src = self.buckets[e.bucket][e.offset:e.offset + e.numel].view(e.shape)
                fresh.copy_(src, non_blocking=pin)
                e.tensor.data = fresh
            if pin:
                torch.cuda.synchronize()  # the host buffers must outlive the copies out of them
        self.buckets.clear()
        self.entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(e.numel * e.tensor.element_size() for e in self.entries)


class MemoryManager:
    """Releases and re-materialises one torch model's parameters, gradient buffers and optimizer states."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        offload_weights: bool,
        offload_optimizer_states: bool,
        free_grad_buffers: bool,
        bucket_size_mb: int,
        device: torch.device | None = None,
    ) -> None:
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        self.model = model
        self.optimizer = optimizer
        self.enabled: dict[str, bool] = {
            "grads": free_grad_buffers,
            "optimizer": offload_optimizer_states and optimizer is not None,
            "weights": offload_weights,
        }
        self.bucket_bytes = bucket_size_mb * _MIB
        if device is None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.max_bucket_bytes: int = 0  # largest staging buffer used so far (for tests)
        self.num_buckets_last_offload: int = 0  # staging buffers created by the last offload() call
        self._resident: dict[str, bool] = dict.fromkeys(PARTS, True)
        self._staged: dict[str, _Staging] = {}

    # -- queries --------------------------------------------------------------------------------------------
    def resident(self, part: str) -> bool:
        """Whether ``part`` is in device memory (True unless this manager offloaded it and has not onloaded it)."""
        _check_parts([part])
        return self._resident[part]

    # -- offload / onload -----------------------------------------------------------------------------------
    def offload(self, parts: Iterable[str] = PARTS) -> dict[str, int]:
        """Release the given parts whose flag is on and that are resident, in ChatLearn's order.

        Returns bytes released per part (0 for a part whose flag is off, or that is already offloaded or empty).
        """
        wanted = set(_check_parts(parts))
        released: dict[str, int] = {}
        self.num_buckets_last_offload = 0
        for part in PARTS:
            if part not in wanted:
                continue
            if not self.enabled[part] or not self._resident[part]:
                released[part] = 0
                continue
            if part == "grads":
                released[part] = self._free_grads()
                self._resident[part] = False
                continue
            tensors = self._weight_tensors() if part == "weights" else self._optimizer_tensors()
            if not tensors:  # e.g. an optimizer before its first step: nothing to release, stays "resident"
                released[part] = 0
                continue
            staging = _Staging.release(tensors, self.bucket_bytes, self.pin)
            self._staged[part] = staging
            self._resident[part] = False
            released[part] = staging.nbytes
            self.num_buckets_last_offload += len(staging.buckets)
            if staging.buckets:
                biggest = max(b.numel() * b.element_size() for b in staging.buckets)
                self.max_bucket_bytes = max(self.max_bucket_bytes, biggest)
        return released

    def onload(self, parts: Iterable[str] = PARTS) -> None:
        """Re-materialise the given parts that are offloaded (grads need nothing: backward recreates them)."""
        wanted = set(_check_parts(parts))
        for part in reversed(PARTS):  # weights first, then optimizer states
            if part not in wanted or self._resident[part]:
                continue
            staging = self._staged.pop(part, None)
            if staging is not None:
                staging.restore(self.pin)
            self._resident[part] = True

    # -- the parts ------------------------------------------------------------------------------------------
    def _free_grads(self) -> int:
        freed = 0
        for p in self.model.parameters():
            if p.grad is not None:
                freed += p.grad.numel() * p.grad.element_size()
                p.grad = None
        return freed

    def _weight_tensors(self) -> list[torch.Tensor]:
        # parameters() deduplicates, so a tied weight is staged and restored once
        return list(self.model.parameters())

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        seen: set[int] = set()
        out: list[torch.Tensor] = []
        for state in self.optimizer.state.values():
            for value in state.values():
                # 0-dim tensors such as `step` stay put: they are tiny and some optimizers read them on the host
                if isinstance(value, torch.Tensor) and value.numel() > 1 and id(value) not in seen:
                    seen.add(id(value))
                    out.append(value)
        return out


def _check_parts(parts: Iterable[str]) -> list[str]:
    names = [parts] if isinstance(parts, str) else list(parts)
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown memory part(s) {unknown}; expected some of {PARTS}")
    return names
