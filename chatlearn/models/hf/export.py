"""`chatlearn export`: any checkpoint iteration of a run as a Hugging Face model (LoRA merged) or a peft adapter.

``export_checkpoint(run_dir, out, iteration=None, to="hf", model=None)`` reads
``run_dir/checkpoints/<model>/iter_N`` (by default the policy trainer's latest iteration), verifies its checksums,
and writes ``out``:

- ``to="hf"``: a directory ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load,
  with exactly the checkpoint's weights; for a LoRA run the adapters merged into the frozen base the run kept in
  ``checkpoints/<model>/base`` (``merged_state_dict``, what the run's sync and ``final/policy`` export hold). Tied
  weights stay tied (stored once, as ``save_pretrained`` does).
- ``to="peft"`` (LoRA runs only): the adapter as peft writes it, which ``PeftModel.from_pretrained(base, out)``
  loads onto the run's base model.

Both come with the tokenizer and a ``README.md`` model card: the run, the iteration and its episode, that
iteration's row of ``metrics.jsonl``, the run's resolved config (``run_config.json``) as YAML, and how to load it.

The model's architecture (``config.json``) and tokenizer come from the run's ``args_dict.model_path`` (relative
paths are taken from the current directory, as the run took them), else from the run's ``final/policy``, else from
``model_path=`` given here; the weights always come from the checkpoint. Everything is written into a temporary
directory next to ``out`` and renamed into place at the end, so ``out`` is complete or untouched. Every refusal is
an `ExportError` (or a `CheckpointError` for a damaged checkpoint) of one line.
"""

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
import yaml
from transformers import AutoModelForCausalLM

from chatlearn.checkpoint.dist_checkpoint import DCP_FORMAT
from chatlearn.checkpoint.model_checkpoint import (
    MANIFEST,
    CheckpointError,
    load_weights,
    replace_dir,
    verify_model_checkpoint,
)
from chatlearn.checkpoint.run_config import RECORD
from chatlearn.config.model import LoraConfig
from chatlearn.models.hf.common import load_tokenizer
from chatlearn.models.hf.lora import BASE_DIR_NAME, apply_lora, load_adapter_state_dict, merged_state_dict
from chatlearn.utils.errors import UserError
from chatlearn.utils.storage import writing
from chatlearn.utils.tied import tied_aliases

__all__ = ["FORMATS", "ExportError", "checkpoint_iterations", "checkpointed_models", "export_checkpoint"]

FORMATS = ("hf", "peft")
DEFAULT_MODEL = "ppo_policy"  # the policy trainer of every built-in engine
CARD = "README.md"
_ITER = re.compile(r"^iter_(\d+)$")


class ExportError(UserError, ValueError):
    """An export refused: no such run, model or iteration, an output in the way, peft without LoRA."""


def checkpointed_models(run_dir: str) -> list[str]:
    """The models with at least one iteration directory under ``run_dir/checkpoints``, sorted."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(m for m in os.listdir(root) if checkpoint_iterations(run_dir, m))


def checkpoint_iterations(run_dir: str, model: str) -> list[int]:
    """The trainer iterations of ``model``'s checkpoint directories (``iter_0000004`` -> 4), ascending; a
    temporary directory of a write in progress is not one."""
    root = os.path.join(run_dir, "checkpoints", model)
    if not os.path.isdir(root):
        return []
    found = (_ITER.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def _read_run_config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, RECORD)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{run_dir}: not a run directory (no {RECORD})") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: unreadable run record ({exc})") from exc
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ExportError(f"{path}: not a run record (no config)")
    return record


def _metrics_row(run_dir: str, iteration: int) -> dict[str, Any] | None:
    """The row of ``metrics.jsonl`` whose trainer iteration is ``iteration`` (the last one, should a resumed run
    have written it twice); None when there is none."""
    row = None
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    item = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a killed run
                if isinstance(item, dict) and item.get("iteration") == iteration:
                    row = item
    except OSError:
        return None
    return row


def _choose_model(run_dir: str, model: str | None) -> str:
    models = checkpointed_models(run_dir)
    if not models:
        raise ExportError(f"{run_dir}: no model checkpoints (nothing under {os.path.join(run_dir, 'checkpoints')}); "
                          "the run saved none yet")
    if model is not None:
        if model not in models:
            raise ExportError(f"{run_dir}: no checkpoints of model {model!r}; there are: {', '.join(models)}")
        return model
    if DEFAULT_MODEL in models:
        return DEFAULT_MODEL
    if len(models) == 1:
        return models[0]
    raise ExportError(f"{run_dir}: checkpoints of several models ({', '.join(models)}); choose one with --model")


def _check_out(out: str, run_dir: str, force: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{out} exists and is not a directory")
    real_out, real_run = os.path.realpath(out), os.path.realpath(run_dir)
    if real_run == real_out or real_run.startswith(real_out + os.sep) or \
            any(real_out.startswith(os.path.join(real_run, d) + os.sep) or real_out == os.path.join(real_run, d)
                for d in ("checkpoints", "data_checkpoints", "final")):
        raise ExportError(f"{out}: refusing to export into the run directory's own files ({run_dir}); "
                          "choose another OUT")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ExportError(f"{out} exists and is not empty; --force replaces it")


def _model_source(record: dict[str, Any], run_dir: str, model: str, model_path: str | None) -> str:
    """The directory the model's config.json and tokenizer come from (see the module docstring)."""
    if model_path is not None:
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ExportError(f"--model-path {model_path}: not a Hugging Face model directory (no config.json)")
        return os.path.abspath(model_path)
    models = record["config"].get("models") or {}
    recorded = ((models.get(model) or {}).get("args_dict") or {}).get("model_path")
    if recorded and os.path.isfile(os.path.join(recorded, "config.json")):
        return os.path.abspath(recorded)
    final = os.path.join(run_dir, "final", "policy")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    if model not in models:
        where = f"the run's config has no model {model!r}, so its model_path"
    elif not recorded:
        where = f"models.{model}.args_dict.model_path (not set)"
    else:
        shown = repr(recorded) if os.path.isabs(recorded) else f"{recorded!r} ({os.path.abspath(recorded)})"
        where = f"models.{model}.args_dict.model_path {shown}"
    raise ExportError(f"{run_dir}: cannot find {model}'s model config and tokenizer: {where} is not a Hugging Face "
                      "model directory from here and the run has no final/policy; run from the directory the run "
                      "was started in, or give --model-path DIR (the model the run trained)")


def _load_full(path: str, manifest: dict[str, Any], model: torch.nn.Module, source: str, name: str) -> None:
    """Put a full-weights checkpoint (single file or sharded) into ``model``, every name of it."""
    if manifest.get("format") == DCP_FORMAT:
        # a sharded checkpoint (DCP) read in this one process: DCP fills the model's own tensors by name, each
        # tied tensor under its first name (the manifest's aliases), as load_sharded does
        state = model.state_dict()
        keep = {k: v for k, v in state.items() if k not in tied_aliases(state)}
        saved = {k.removeprefix("model.") for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
                 if k.startswith("model.")}
        _same_names(path, saved, set(keep), source, name)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({"model": keep}, checkpoint_id=path)
        return
    weights = load_weights(os.path.join(path, "model.safetensors"))
    _same_names(path, set(weights), set(model.state_dict()), source, name)
    model.load_state_dict(weights, strict=True)


def _same_names(path: str, saved: set[str], expected: set[str], source: str, name: str) -> None:
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        raise ExportError(f"{path}: its weights do not fit the causal LM at {source} ({len(missing)} missing, e.g. "
                          f"{missing[:3]}; {len(unexpected)} unexpected, e.g. {unexpected[:3]}): {name} is not a "
                          "causal LM of that architecture (only a policy exports; or --model-path names another "
                          "model)")


def _load_lora(path: str, manifest: dict[str, Any], model: torch.nn.Module, source: str, name: str):
    """A peft model: the run's frozen base (verified: its checksums and the SHA-256 the checkpoint recorded) with
    the checkpoint's adapters; and whether the base equals the model at ``source``."""
    lora = manifest["meta"]["lora"]
    base_dir = os.path.join(os.path.dirname(path), lora.get("base_dir", BASE_DIR_NAME))
    if not os.path.isfile(os.path.join(base_dir, MANIFEST)):
        raise CheckpointError(f"{base_dir}: the frozen base of {name}'s LoRA checkpoints is missing")
    base_manifest = verify_model_checkpoint(base_dir)
    if base_manifest["files"].get("model.safetensors") != lora.get("base_sha256"):
        raise CheckpointError(f"{path}: its adapters were trained on another base than {base_dir}")
    base = load_weights(os.path.join(base_dir, "model.safetensors"))
    _same_names(base_dir, set(base), set(model.state_dict()), source, name)
    current = model.state_dict()
    same_base = all(torch.equal(current[k], v) for k, v in base.items())
    model.load_state_dict(base, strict=True)
    with warnings.catch_warnings():  # peft 0.21 calls a transformers API that 5.x deprecates: not the user's to fix
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        peft_model = apply_lora(model, LoraConfig.model_validate(lora["config"]))
    adapters = load_weights(os.path.join(path, "model.safetensors"))
    try:
        load_adapter_state_dict(peft_model, adapters)
    except ValueError as exc:
        raise CheckpointError(f"{path}: its adapters do not fit its LoRA config: {exc}") from exc
    return peft_model.eval(), same_base


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False, allow_unicode=True).rstrip()


def _flat(row: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in row.items():
        if isinstance(value, dict) and value:
            out.extend(_flat(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def model_card(*, record: dict[str, Any], run_dir: str, model: str, iteration: int, to: str, lora: bool,
               row: dict[str, Any] | None, checkpoint: str, base_path: str | None, same_base: bool) -> str:
    """The ``README.md`` of an export (Hugging Face model card: YAML front matter, then markdown)."""
    cfg = record["config"]
    runtime = cfg.get("runtime") or {}
    exp = runtime.get("exp_name") or os.path.basename(run_dir)
    engine = runtime.get("engine", "")
    front = {"library_name": "peft" if to == "peft" else "transformers", "pipeline_tag": "text-generation",
             "tags": ["chatlearn", *([engine] if engine else []), *(["lora"] if lora else [])]}
    if to == "peft" and base_path:
        front["base_model"] = base_path
    episode = f"episode {row['episode']} of the run" \
        if row and isinstance(row.get("episode"), int) else "no episode of metrics.jsonl has this iteration"
    kind = {("hf", False): "a Hugging Face model", ("hf", True): "a Hugging Face model, the LoRA adapters merged "
            "into the base", ("peft", True): "a peft LoRA adapter"}[(to, lora)]
    lines = ["---", _yaml(front), "---", "", f"# {exp}: {model}, iteration {iteration}", "",
             f"{kind[0].upper()}{kind[1:]}, exported by `chatlearn export` from the run directory `{run_dir}`.", "",
             f"- run: `{exp}` (engine `{engine}`), status `{record.get('status')}`, "
             f"{record.get('episodes_done')} of {record.get('num_episode')} episodes done",
             f"- model: `{model}`, trainer iteration {iteration}: {episode}",
             f"- checkpoint: `{checkpoint}`"]
    if lora:
        kept = os.path.join(os.path.dirname(checkpoint), BASE_DIR_NAME)
        if base_path is None:
            lines.append(f"- base model: the run's model_path, not found where this was exported; `{kept}` keeps "
                         "its weights")
        else:
            lines.append(f"- base model: `{base_path}`" + ("" if same_base else "; its weights now differ from the "
                         f"base the run trained on, which `{kept}` keeps"))
    lines += ["", "## How to load", "", "```python"]
    if to == "peft":
        lines += ["from peft import PeftModel", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f"base = AutoModelForCausalLM.from_pretrained({base_path or 'BASE_MODEL_DIR'!r})",
                  "model = PeftModel.from_pretrained(base, \"THIS_DIRECTORY\")",
                  "tokenizer = AutoTokenizer.from_pretrained(\"THIS_DIRECTORY\")",
                  "# model.merge_and_unload() gives the plain merged model"]
    else:
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  "model = AutoModelForCausalLM.from_pretrained(\"THIS_DIRECTORY\")",
                  "tokenizer = AutoTokenizer.from_pretrained(\"THIS_DIRECTORY\")"]
    lines += ["```", "", f"## Metrics of iteration {iteration}", ""]
    if row:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {key} | {json.dumps(value)} |" for key, value in _flat(row)]
    else:
        lines.append(f"metrics.jsonl has no row with `iteration: {iteration}`.")
    lines += ["", "## Config", "", f"The resolved config of the run (`{RECORD}`):", "", "```yaml", _yaml(cfg),
              "```", ""]
    return "\n".join(lines)


def _write(tmp: str, out: str, to: str, lora: bool, net: Any, base_path: str | None, tokenizer: Any,
           card: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        if to == "peft":
            net.peft_config["default"].base_model_name_or_path = base_path
            # the embeddings are not resized: the adapter holds only the adapter tensors
            net.save_pretrained(tmp, save_embedding_layers=False)
        elif lora:
            net.get_base_model().save_pretrained(tmp, state_dict=merged_state_dict(net))
        else:
            net.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, CARD), "w", encoding="utf-8") as f:
            f.write(card)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_checkpoint(run_dir: str, out: str, iteration: int | None = None, to: Literal["hf", "peft"] = "hf",
                      model: str | None = None, force: bool = False, model_path: str | None = None,
                      announce: Callable[[str], Any] | None = None) -> str:
    """Export ``model``'s checkpoint of trainer ``iteration`` (default: the latest) of the run in ``run_dir`` to
    ``out`` (see the module docstring); returns ``out``. ``model`` defaults to ``ppo_policy`` (or the run's only
    checkpointed model); ``force`` replaces a non-empty ``out``; ``model_path`` names the directory the model's
    config and tokenizer come from when the run's ``model_path`` is not found from here; ``announce`` gets one line
    saying what was written."""
    if to not in FORMATS:
        raise ExportError(f"unknown export format {to!r}; one of: {', '.join(FORMATS)}")
    if not os.path.isdir(run_dir):
        raise ExportError(f"{run_dir}: no such run directory")
    run_dir, out = os.path.abspath(run_dir), os.path.abspath(out)
    record = _read_run_config(run_dir)
    name = _choose_model(run_dir, model)
    iterations = checkpoint_iterations(run_dir, name)
    if iteration is None:
        iteration = iterations[-1]
    elif iteration not in iterations:
        raise ExportError(f"{run_dir}: {name} has no checkpoint of iteration {iteration}; there are: "
                          f"{', '.join(map(str, iterations))}")
    path = os.path.join(run_dir, "checkpoints", name, f"iter_{iteration:07d}")
    manifest = verify_model_checkpoint(path)  # checksums: a damaged file is a CheckpointError naming it
    lora = bool((manifest.get("meta") or {}).get("lora"))
    if to == "peft" and not lora:
        raise ExportError(f"{run_dir}: {name} was trained without LoRA (models.{name}.lora.enable_lora: false), so "
                          "it has no adapter to export as peft; --to hf exports the model")
    _check_out(out, run_dir, force)
    source = _model_source(record, run_dir, name, model_path)
    args = ((record["config"].get("models") or {}).get(name) or {}).get("args_dict") or {}
    net = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, args.get("dtype") or "float32"))
    same_base = True
    if lora:
        peft_model, same_base = _load_lora(path, manifest, net, source, name)
    else:
        _load_full(path, manifest, net, source, name)
    tokenizer = load_tokenizer(source)
    # the base a peft adapter goes on: the model the run loaded (final/policy, a fallback, is merged: not it)
    base_path = None if source == os.path.join(run_dir, "final", "policy") else source
    card = model_card(record=record, run_dir=run_dir, model=name, iteration=iteration, to=to, lora=lora,
                      row=_metrics_row(run_dir, iteration), checkpoint=path, base_path=base_path if lora else None,
                      same_base=same_base)

    tmp = f"{out}.tmp-{os.getpid()}"  # next to OUT, renamed into place when complete
    # a failed write (a full disk) is one line naming OUT and the OS error, the temporary directory removed
    with writing("the export", out, cleanup=tmp):
        _write(tmp, out, to, lora, peft_model if lora else net, base_path, tokenizer, card)
    if announce is not None:
        what = "a peft adapter" if to == "peft" else "a Hugging Face model" + (" (LoRA merged)" if lora else "")
        announce(f"exported {name} iteration {iteration} of {run_dir} as {what}: {out}")
    return out
