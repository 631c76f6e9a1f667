"""LoRA for the built-in Hugging Face trainers: ChatLearn's ``models.<name>.lora`` section, acted on with peft.

ChatLearn 1.0.2 converts Megatron layer *classes* to LoRA layers (``lora_layer`` names the classes). A Hugging
Face decoder LM has no such classes, only ``nn.Linear``/``nn.Embedding`` modules with conventional names, so
each ChatLearn class name is mapped to the module kinds that play its role in a Megatron model:

================================  ===============================================================================
``lora_layer`` entry              Hugging Face modules selected
================================  ===============================================================================
``ColumnParallelLinear``          linears whose output is split in Megatron (column-parallel): ``q_proj``,
                                  ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` and the fused/other-family
                                  names ``qkv_proj``, ``gate_up_proj``, ``c_attn``, ``query_key_value``,
                                  ``W_pack``, ``Wqkv``, ``query``, ``key``, ``value``, ``c_fc``, ``fc1``,
                                  ``dense_h_to_4h``, ``w1``, ``w3`` (see :data:`COLUMN_PARALLEL_NAMES`)
``RowParallelLinear``             linears whose input is split (row-parallel): ``o_proj``, ``down_proj``,
                                  ``dense``, ``c_proj``, ``out_proj``, ``dense_4h_to_h``, ``fc2``, ``w2``
                                  (see :data:`ROW_PARALLEL_NAMES`)
``LinearLayer``                   every other ``nn.Linear`` (or GPT-2 style ``Conv1D``): ``lm_head``, MoE routers
``Embedding``                     ``nn.Embedding`` modules (``embed_tokens``, GPT-2's ``wte``/``wpe``)
``VocabParallelEmbedding``        the same ``nn.Embedding`` modules (a HF model has no vocab-parallel class)
================================  ===============================================================================

A module is classified by the last component of its qualified name, which is how HF models name their roles.
The other fields act as in ChatLearn's ``convert_layer_to_lora``:

* ``column_only_qkv`` keeps, *among the ColumnParallelLinear modules*, only the attention q/k/v projections
  (separate or fused, :data:`QKV_NAMES`); RowParallelLinear/LinearLayer/Embedding entries of ``lora_layer``
  still select their modules, exactly as ChatLearn only filters its ``ColumnParallelLinear`` branch. Use
  ``lora_layer: ColumnParallelLinear`` with it for "q/k/v only".
* ``part_module_name`` keeps only modules whose qualified name contains that string (``"layers.0."``).
* ``lora_dim`` is peft's ``r``; ``lora_dropout`` peft's ``lora_dropout`` (the dropout on the adapter input).
* ``lora_scaling``: ChatLearn merges ``W + B·A · lora_scaling``; peft merges ``W + B·A · lora_alpha / r``,
  so ``lora_alpha = lora_scaling * lora_dim``. ``(s * r) / r`` is not always exactly ``s`` in floating point,
  so after building the adapters the per-layer scaling is pinned to ``lora_scaling`` itself.

Tied weights. When two selected modules share one weight tensor (``tie_word_embeddings``: ``lm_head`` and
``embed_tokens``) both are skipped, whichever ``lora_layer`` entries chose them. peft adapts a module, not a
tensor: an embedding LoRA changes only the input look-up while training, but merging it writes into the shared
matrix and so changes ``lm_head`` too (and an ``lm_head`` LoRA would change the input embeddings on merge), so
the merged model would not compute what was trained. peft's own ``ensure_weight_tying`` does not fix this in
peft 0.21 (its merge double-counts the delta on the shared matrix), so it is not used.

Only the adapter tensors train. The synced/exported weights are the merged ones under the plain HF names, so
the inference copies and exported models never need peft.
"""

import json
import logging
import os
import shutil
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import Embedding as LoraEmbedding
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from chatlearn.checkpoint.model_checkpoint import (
    MANIFEST,
    CheckpointError,
    capture_rng_state,
    load_model_checkpoint,
    replace_dir,
    restore_rng_state,
    save_model_checkpoint,
)
from chatlearn.config.model import LoraConfig
from chatlearn.models.parallel import full_tensors
from chatlearn.utils.finite import check_finite_tensors

__all__ = [
    "ADAPTER_NAME",
    "BASE_DIR_NAME",
    "COLUMN_PARALLEL_NAMES",
    "LAYER_KINDS",
    "QKV_NAMES",
    "ROW_PARALLEL_NAMES",
    "LoraTrainerMixin",
    "adapter_state_dict",
    "apply_lora",
    "base_state_dict",
    "load_adapter_state_dict",
    "lora_target_modules",
    "merged_state_dict",
    "param_counts",
    "parse_lora_layer",
]

logger = logging.getLogger("chatlearn")

ADAPTER_NAME = "default"
BASE_DIR_NAME = "base"

#: ChatLearn ``lora_layer`` class name -> kind of Hugging Face module it selects.
LAYER_KINDS: dict[str, str] = {
    "ColumnParallelLinear": "column",
    "RowParallelLinear": "row",
    "LinearLayer": "linear",
    "Embedding": "embedding",
    "VocabParallelEmbedding": "embedding",
}
#: Attention q/k/v projections, separate or fused (Llama/Qwen2, Phi-3, GPT-2, NeoX/Falcon, Baichuan, MPT, BERT).
QKV_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "W_pack", "Wqkv",
                       "query", "key", "value"})
#: Column-parallel linears in Megatron: attention q/k/v and the MLP up/gate projections.
COLUMN_PARALLEL_NAMES = QKV_NAMES | {"gate_proj", "up_proj", "gate_up_proj", "c_fc", "fc1", "dense_h_to_4h",
                                     "w1", "w3"}
#: Row-parallel linears in Megatron: attention output and MLP down projections.
ROW_PARALLEL_NAMES = frozenset({"o_proj", "down_proj", "dense", "c_proj", "out_proj", "dense_4h_to_h", "fc2", "w2"})

_LINEAR_TYPES = (nn.Linear, Conv1D)


# -- which modules ----------------------------------------------------------------------------------------------
def parse_lora_layer(lora_layer: str) -> list[str]:
    """The class names of ``lora_layer`` (comma-separated), validated: an unknown name is a ``ValueError``
    naming it and the known ones, since a typo would otherwise silently train fewer layers."""
    names = [n.strip() for n in lora_layer.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYER_KINDS]
    if unknown:
        raise ValueError(f"lora.lora_layer: unknown layer name(s) {unknown}; known: {sorted(LAYER_KINDS)}")
    if not names:
        raise ValueError(f"lora.lora_layer is empty; name some of {sorted(LAYER_KINDS)}")
    return names


def _module_kind(name: str, module: nn.Module) -> str | None:
    """'column'/'row'/'linear'/'embedding' for a module LoRA can adapt, None for any other module."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, _LINEAR_TYPES):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN_PARALLEL_NAMES:
            return "column"
        if leaf in ROW_PARALLEL_NAMES:
            return "row"
        return "linear"
    return None


def _tied_names(candidates: dict[str, nn.Module]) -> set[str]:
    """Names of the candidate modules whose weight tensor is shared with another candidate."""
    owners: dict[int, list[str]] = {}
    for name, module in candidates.items():
        owners.setdefault(id(module.weight), []).append(name)
    return {n for names in owners.values() if len(names) > 1 for n in names}


def lora_target_modules(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Qualified names of the modules of ``model`` that ``cfg`` converts to LoRA, in ``named_modules`` order.

    Filters, in order: layer kind (``lora_layer``, see the module docstring), ``column_only_qkv`` (q/k/v only
    among the column-parallel modules), ``part_module_name`` (substring of the qualified name), then modules with
    tied weights are dropped (see "Tied weights" above). ``ValueError`` names the filter that left nothing.
    """
    kinds = {LAYER_KINDS[n] for n in parse_lora_layer(cfg.lora_layer)}
    candidates = {n: m for n, m in model.named_modules() if n and _module_kind(n, m) is not None}
    if any(isinstance(m, LoraLayer) for m in model.modules()):
        raise ValueError("the model already has LoRA layers; apply LoRA to a plain model")
    of_kind = [n for n, m in candidates.items() if _module_kind(n, m) in kinds]
    qkv = [n for n in of_kind
           if not (cfg.column_only_qkv and _module_kind(n, candidates[n]) == "column"
                   and n.rsplit(".", 1)[-1] not in QKV_NAMES)]
    scoped = [n for n in qkv if cfg.part_module_name is None or cfg.part_module_name in n]
    tied = _tied_names(candidates)
    skipped = [n for n in scoped if n in tied]
    targets = [n for n in scoped if n not in tied]
    if skipped:
        logger.warning("LoRA skips %s: their weight is tied (shared), and a LoRA on a shared matrix would not "
                       "merge into what was trained", skipped)
    if not targets:
        raise ValueError(
            f"LoRA selects no module: {len(candidates)} Linear/Embedding modules, {len(of_kind)} of lora_layer "
            f"{cfg.lora_layer!r}, {len(qkv)} left by column_only_qkv={cfg.column_only_qkv}, {len(scoped)} left by "
            f"part_module_name={cfg.part_module_name!r}, 0 left once tied-weight modules {skipped} are skipped"
        )
    return targets


# -- wrapping ---------------------------------------------------------------------------------------------------
def _hf_model(model: nn.Module) -> nn.Module:
    """The model whose state-dict keys are the plain HF names (plus peft's ``base_layer``/``lora_*`` parts)."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def _lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def apply_lora(model: nn.Module, cfg: LoraConfig) -> PeftModel:
    """Wrap ``model`` (modified in place, as peft does) with a LoRA adapter per ChatLearn's ``cfg``.

    ``target_modules`` is the exact list of :func:`lora_target_modules`, so what peft adapts is what the
    mapping documents (the injected set is checked against it). Afterwards only adapter tensors require grad;
    build the optimizer after this call.
    """
    if cfg.lora_dim <= 0:
        raise ValueError(f"lora.lora_dim must be positive, got {cfg.lora_dim}")
    targets = lora_target_modules(model, cfg)
    can_generate = isinstance(model, PreTrainedModel) and model.can_generate()
    peft_cfg = PeftLoraConfig(
        r=cfg.lora_dim,
        lora_alpha=cfg.lora_scaling * cfg.lora_dim,  # peft scaling = lora_alpha / r = lora_scaling
        lora_dropout=cfg.lora_dropout,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM" if can_generate else None,
    )
    peft_model = get_peft_model(model, peft_cfg, adapter_name=ADAPTER_NAME)
    layers = _lora_layers(_hf_model(peft_model))
    if sorted(layers) != sorted(targets):
        raise RuntimeError(f"peft adapted {sorted(layers)}, expected {sorted(targets)}")
    for layer in layers.values():
        layer.scaling[ADAPTER_NAME] = float(cfg.lora_scaling)  # exact, not (s * r) / r
    adapter_ids = {id(t) for t in _adapter_params(peft_model)}
    for p in peft_model.parameters():
        p.requires_grad_(id(p) in adapter_ids)
    return peft_model


# -- state dicts ------------------------------------------------------------------------------------------------
def _split_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, LoraLayer]]:
    """(base weights under plain HF keys, adapter tensors under their keys, plain weight key -> its LoRA layer)."""
    hf = _hf_model(model)
    layers = _lora_layers(hf)
    base: dict[str, torch.Tensor] = {}
    adapters: dict[str, torch.Tensor] = {}
    by_weight = {f"{n}.weight": layer for n, layer in layers.items()}
    for key, tensor in hf.state_dict().items():
        parts = key.split(".")
        owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in layers),
                     None)
        if owner is None:
            base[key] = tensor
            continue
        rest = key[len(owner) + 1:]
        if rest.startswith("base_layer."):
            base[f"{owner}.{rest[len('base_layer.'):]}"] = tensor
        elif rest.split(".", 1)[0] in layers[owner].adapter_layer_names:
            adapters[key] = tensor
        else:
            raise RuntimeError(f"unexpected state-dict key {key!r} in LoRA layer {owner!r}")
    return base, adapters, by_weight


def _adapter_params(model: nn.Module) -> list[nn.Parameter]:
    out: list[nn.Parameter] = []
    for layer in _lora_layers(_hf_model(model)).values():
        for attr in layer.adapter_layer_names:
            container = getattr(layer, attr, None)
            if container is not None:
                out.extend(container.parameters())
    return out


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights under the plain HF keys (a plain model's own ``state_dict``). The tensors share
    storage with the model."""
    return _split_state(model)[0]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (``lora_A``/``lora_B``/``lora_embedding_A``/``lora_embedding_B``), keyed as in
    the HF model's state dict (e.g. ``model.layers.0.self_attn.q_proj.lora_A.default.weight``); the tensors share
    storage with the model, so clone them to keep a snapshot."""
    return _split_state(model)[1]


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load :func:`adapter_state_dict` output; the key sets must match exactly (shapes are checked by torch), so
    a checkpoint of another LoRA config fails instead of loading half of it."""
    expected = set(adapter_state_dict(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"adapter state mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    result = _hf_model(model).load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"adapter state mismatch: unexpected={result.unexpected_keys[:5]}")


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``model`` with its active adapters merged, under the plain HF keys, without touching the
    model (it keeps training on its separate adapters).

    Each merged weight is computed exactly as peft's ``merge()`` does it (same ``get_delta_weight``, same
    in-place add onto a copy of the base weight, including its dtype handling: Linear adds the adapter-dtype
    delta into the base dtype, Embedding casts the delta first), so the result is bit-identical
    (``torch.equal``) to ``copy.deepcopy(model).merge_and_unload().state_dict()``. Weights without an adapter
    share storage with the model (they are frozen).
    """
    base, _, by_weight = _split_state(model)
    out = dict(base)
    for key, layer in by_weight.items():
        if layer.merged:  # the base weight already holds the delta
            continue
        if not isinstance(layer, LoraLinear | LoraEmbedding):
            raise NotImplementedError(f"merging {type(layer).__name__} ({key}) is not supported")
        weight = base[key].clone()
        for adapter in layer.active_adapters:
            if adapter not in layer.r:
                continue
            if adapter in layer.lora_variant:
                raise NotImplementedError(f"merging LoRA variants ({key}) is not supported")
            delta = layer.get_delta_weight(adapter)
            weight += delta if isinstance(layer, LoraLinear) else delta.to(weight.dtype)
        out[key] = weight
    return out


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts: trainable = elements of parameters that require grad; total = the
    base model's parameters (adapters excluded, a tied weight counted once), so a LoRA model reports the size
    of the model it adapts, as a plain one does."""
    adapter_ids = {id(p) for p in _adapter_params(model)}
    params = list(model.parameters())  # deduplicated: a tied weight appears once
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params if id(p) not in adapter_ids)
    return trainable, total


def _check_same_weights(path: str, saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    if set(saved) != set(current):
        diff = sorted(set(saved) ^ set(current))
        raise CheckpointError(f"{path}: the saved LoRA base has other weights than this model's ({diff[:5]})")
    for key, tensor in current.items():
        if not torch.equal(saved[key], tensor.detach().to(saved[key].device)):
            raise CheckpointError(f"{path}: the saved LoRA base differs from this model's base at {key}")


# -- the trainer mixin ------------------------------------------------------------------------------------------
class LoraTrainerMixin:
    """LoRA for a ``TorchModule`` trainer: mix in first, ``class T(LoraTrainerMixin, PPOPolicyTrainer)``.

    The trainer's ``setup`` builds ``self.model`` (an HF causal LM), ``self.tokenizer``, and calls
    :meth:`maybe_apply_lora` *before* building ``self.optimizer``/``self.scheduler`` (so the optimizer holds the
    adapters, the only parameters that require grad). With ``lora.enable_lora`` false every method behaves as the
    plain trainer's.

    With LoRA on: ``get_weights`` returns the merged weights under plain HF names; a checkpoint directory holds
    only the adapters plus optimizer/scheduler/RNG state, and the frozen base is written once, checksummed, to
    ``<run_dir>/checkpoints/<name>/base`` (next to the ``iter_*`` directories), which loading verifies against
    the model's base (and each checkpoint records the base's SHA-256, so adapters never load onto another base).
    """

    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    tokenizer: Any = None
    lora_enabled: bool = False
    _lora_base_verified: str | None = None

    # provided by BaseModule/TorchModule (declared for readers and type checkers; no values, no overrides)
    name: str
    module_args: Any
    checkpoint_dir: Any
    device: Any

    def maybe_apply_lora(self) -> bool:
        """Wrap ``self.model`` with LoRA when ``module_args.lora.enable_lora``; records ``self.lora_enabled``."""
        cfg = self.module_args.lora
        self.lora_enabled = bool(cfg.enable_lora)
        if self.lora_enabled:
            self.model = apply_lora(self.model, cfg)
            trainable, total = param_counts(self.model)
            logger.info("%s: LoRA on %d modules, %d trainable of %d parameters", self.name,
                        len(_lora_layers(_hf_model(self.model))), trainable, total)
        return self.lora_enabled

    # -- parameter sync ---------------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """Merged weights under plain HF names when LoRA is on (the inference copies never need peft)."""
        if not self.lora_enabled:
            return super().get_weights()  # type: ignore[misc]
        return full_tensors(merged_state_dict(self.model), "cpu")

    def sync_sources(self) -> dict[str, torch.Tensor]:
        """What a collective sync sends: the merged weights under plain HF names when LoRA is on."""
        if not self.lora_enabled:
            return super().sync_sources()  # type: ignore[misc]
        return dict(merged_state_dict(self.model))

    # -- checkpoints ------------------------------------------------------------------------------------------
    def lora_base_dir(self) -> str:
        """Where the frozen base goes: ``<run_dir>/checkpoints/<name>/base``, a sibling of the iteration dirs."""
        return os.path.join(os.path.dirname(self.checkpoint_dir(0)), BASE_DIR_NAME)

    def _lora_base_sha(self, *, create: bool) -> str:
        """SHA-256 of the saved base weights file, writing the base first if ``create`` and it is absent.

        An existing base is verified (checksums, then tensor equality with this model's base) on every load and
        on the first save of a process; the base is frozen, so later saves of the same process skip the check.
        """
        path = self.lora_base_dir()
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            if not create:
                raise CheckpointError(f"{path}: the frozen base of {self.name}'s LoRA checkpoints is missing")
            save_model_checkpoint(path, base_state_dict(self.model), meta={"model": self.name, "lora_base": True})
            self._lora_base_verified = path
        elif not create or self._lora_base_verified != path:
            state = load_model_checkpoint(path)
            _check_same_weights(path, state["weights"], base_state_dict(self.model))
            self._lora_base_verified = path
        with open(manifest_path) as f:
            return json.load(f)["files"]["model.safetensors"]

    def save_checkpoint(self, iteration: int) -> str | None:
        """LoRA on: adapters + optimizer/scheduler/RNG in the iteration dir, the base once in :meth:`lora_base_dir`."""
        if not self.lora_enabled:
            return super().save_checkpoint(iteration)  # type: ignore[misc]
        base_sha = self._lora_base_sha(create=True)
        return save_model_checkpoint(
            self.checkpoint_dir(iteration),
            adapter_state_dict(self.model),
            optimizer=self.optimizer.state_dict() if self.optimizer is not None else None,
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
            rng=capture_rng_state(),
            meta={"model": self.name, "iteration": iteration,
                  "lora": {"base_dir": BASE_DIR_NAME, "base_sha256": base_sha,
                           "config": self.module_args.lora.model_dump()}},
        )

    def load_checkpoint(self, iteration: int) -> None:
        """Restore adapters/optimizer/scheduler/RNG after verifying the checkpoint and that its base is ours."""
        if not self.lora_enabled:
            super().load_checkpoint(iteration)  # type: ignore[misc]
            return
        path = self.checkpoint_dir(iteration)
        state = load_model_checkpoint(path, map_location=self.device)
        lora_meta = state["meta"].get("lora")
        if lora_meta is None:
            raise CheckpointError(f"{path}: saved without LoRA, but {self.name} has LoRA enabled")
        base_sha = self._lora_base_sha(create=False)
        if lora_meta.get("base_sha256") != base_sha:
            raise CheckpointError(f"{path}: its adapters were trained on another base than {self.lora_base_dir()}")
        load_adapter_state_dict(self.model, state["weights"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["rng"] is not None:
            restore_rng_state(state["rng"])

    # -- export -----------------------------------------------------------------------------------------------
    def export_hf(self, path: str) -> str:
        """Save a plain transformers model (merged when LoRA is on) and the tokenizer at ``path``, atomically:
        written to a temporary sibling and renamed into place, so ``path`` is never half-written."""
        full = None
        if self.parallel is not None and not self.lora_enabled:
            # every rank gathers (a collective for sharded weights and pipeline stages); rank 0 writes
            self.gather_stages()
            full = full_tensors(self.model.state_dict(), "cpu")  # tied weights stay one: written once
            if self.rank != 0:
                return path
        # NaN weights are a RunError, nothing is written: the exported policy is what users deploy
        check_finite_tensors(full if full is not None else self.model.state_dict(), f"{path} not written: weight")
        tmp = f"{path}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            if self.lora_enabled:
                _hf_model(self.model).save_pretrained(tmp, state_dict=merged_state_dict(self.model))
            else:
                self.model.save_pretrained(tmp, state_dict=full)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def info(self) -> dict[str, Any]:
        """Adds ``trainable_params`` (the adapters when LoRA is on) and ``total_params`` (the base model)."""
        out = super().info()  # type: ignore[misc]
        if self.model is not None:
            trainable, total = param_counts(self.model)
            if self.lora_enabled:
                trainable = sum(t.numel() for t in adapter_state_dict(self.model).values())
            out.update(trainable_params=trainable, total_params=total)
        return out
