"""Build the embedded tiny model: a character-level tokenizer and a random-init Llama (or Qwen2), saved locally.

There is no model hub on the machines this project runs on, so the default config points `model_path` at a
directory that this module fills on first use. Only that directory: the config names it as `tiny_model_path`
(configs/tiny_llama.yaml) and a model whose `model_path` is elsewhere never gets a tiny model built for it
(`chatlearn.models.hf.common.builds_tiny_model`), so a typo is an error. Everything downstream loads it with
the ordinary `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained`, exactly as it would a real
Hugging Face checkpoint, so the real loading code is what gets exercised.

`architecture: qwen2` builds a Qwen2 instead (configs/tiny_qwen2.yaml): q/k/v biases and, as set there, tied
input/output embeddings and grouped-query attention, the shape of the small real models (Qwen2.5-0.5B,
Qwen3-0.6B, Llama-3.2-1B tie their embeddings), so the code paths those need are exercised on CPU too.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# Characters of the vocabulary: digits first (the verifiable tasks answer in digits), then a few symbols and
# lowercase letters so prompts stay readable.
CHARACTERS = list("0123456789") + list(" +-*=?:,.>") + list("abcdefghijklmnopqrstuvwxyz")


# architecture -> (config class, model class) of the tiny model
ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


class TinyModelSpec(BaseModel):
    """Shape of the random-init model. Defaults give a Llama of about 2.6 M parameters, fast on two CPU cores."""

    model_config = ConfigDict(extra="forbid")

    architecture: Literal["llama", "qwen2"] = "llama"
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 64
    tie_word_embeddings: bool = False
    seed: int = 1234


def build_char_tokenizer():
    """A fast tokenizer with one token per character, BOS prepended, loadable by `AutoTokenizer`."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
    )


def ensure_tiny_model(path: str | os.PathLike, spec: TinyModelSpec | dict | None = None) -> Path:
    """Create tokenizer + random-init causal LM (`spec.architecture`) at `path` unless a model with the same spec
    is there.

    Written into a temporary sibling directory and renamed into place, so a crash never leaves a half-written
    model that later runs would load. Same spec (including seed) gives bit-identical weights on CPU.
    """
    spec = TinyModelSpec.model_validate(spec or {})
    path = Path(path).expanduser().resolve()
    marker = path / "chatlearn_tiny_spec.json"
    if marker.exists():
        if _same_spec(marker, spec):
            return path
        raise ValueError(
            f"{path} holds a tiny model built with a different spec ({marker.read_text().strip()}); "
            "remove it or point model_path elsewhere"
        )
    if (path / "config.json").exists():
        return path  # a real (e.g. trained and exported) model: load it as it is
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists and is not a chatlearn tiny model; refusing to overwrite it")

    tokenizer = build_char_tokenizer()
    config_class, model_class = ARCHITECTURES[spec.architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    try:
        model = model_class(config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "chatlearn_tiny_spec.json").write_text(json.dumps(spec.model_dump()))
        if path.exists():
            path.rmdir()
        try:
            os.replace(tmp, path)
        except OSError:
            # another process built it concurrently: keep theirs if it is the same spec
            if marker.exists() and _same_spec(marker, spec):
                shutil.rmtree(tmp, ignore_errors=True)
                return path
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _same_spec(marker: Path, spec: TinyModelSpec) -> bool:
    """Whether the model at ``marker``'s directory was built with ``spec`` (a marker written before a field
    existed holds that field's default)."""
    try:
        return TinyModelSpec.model_validate(json.loads(marker.read_text())) == spec
    except ValueError:
        return False
