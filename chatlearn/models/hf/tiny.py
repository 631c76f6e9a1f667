"""Build the embedded tiny model: a tokenizer and a random-init Llama (or Qwen2, Qwen3, Mistral), saved locally.

There is no model hub on the machines this project runs on, so the default config points `model_path` at a
directory that this module fills on first use. Only that directory: the config names it as `tiny_model_path`
(configs/tiny_llama.yaml) and a model whose `model_path` is elsewhere never gets a tiny model built for it
(`chatlearn.models.hf.common.builds_tiny_model`), so a typo is an error. Everything downstream loads it with
the ordinary `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained`, exactly as it would a real
Hugging Face checkpoint, so the real loading code is what gets exercised.

`architecture: qwen2` builds a Qwen2 instead (configs/tiny_qwen2.yaml): q/k/v biases and, as set there, tied
input/output embeddings and grouped-query attention, the shape of the small real models (Qwen2.5-0.5B,
Qwen3-0.6B, Llama-3.2-1B tie their embeddings), so the code paths those need are exercised on CPU too.
`architecture: qwen3` (configs/tiny_qwen3.yaml) adds Qwen3's per-head q/k norms and a `head_dim` apart from
hidden_size / heads; `architecture: mistral` (configs/tiny_mistral.yaml) Mistral's sliding-window attention.

The tokenizer is one token per character (`tokenizer: char`, the default: the max-digit tasks read answers digit
by digit) or, with `tokenizer: family`, a BPE tokenizer in the format of the architecture's family: its special
tokens, EOS/pad/BOS roles and chat template (`build_family_tokenizer`).
"""

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE, WordLevel
from tokenizers.trainers import BpeTrainer
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from chatlearn.utils.imports import import_callable

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# Characters of the vocabulary: digits first (the verifiable tasks answer in digits), then a few symbols and
# lowercase letters so prompts stay readable.
CHARACTERS = list("0123456789") + list(" +-*=?:,.>") + list("abcdefghijklmnopqrstuvwxyz")


# architecture -> (config class, model class) of the tiny model
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


# warm_start name -> the function run as ``fn(model, tokenizer, seed=spec.seed)``, by name so that a config
# (or a deployment's run form) chooses among these and names no code of its own
WARM_STARTS = {"calculator": "chatlearn.tasks.agent_calculator:warm_start"}  # the tool-call format


class TinyModelSpec(BaseModel):
    """Shape of the random-init model. Defaults give a Llama of about 2.6 M parameters, fast on two CPU cores."""

    model_config = ConfigDict(extra="forbid")

    architecture: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 64
    tie_word_embeddings: bool = False
    # per-head width where the family sets it apart from hidden_size / num_attention_heads (Qwen3: 128 with
    # 16 heads over a hidden size of 1024); None: hidden_size / num_attention_heads
    head_dim: int | None = None
    # Mistral: each token attends to at most this many previous positions (None: no window)
    sliding_window: int | None = None
    # "char": one token per character (this project's own; the max-digit tasks read answers digit by digit);
    # "family": a BPE tokenizer.json in the format of the architecture's family, with its special tokens and chat
    # template (`build_family_tokenizer`)
    tokenizer: Literal["char", "family"] = "char"
    seed: int = 1234
    # a supervised warm-up run on the random-init model before it is saved (`WARM_STARTS`), standing in for the
    # instruction tuning RL starts from on real models; None: the random init as it is
    warm_start: Literal[tuple(WARM_STARTS)] | None = None

    @model_validator(mode="after")
    def _family_traits(self) -> "TinyModelSpec":
        if self.sliding_window is not None and self.architecture != "mistral":
            raise ValueError(f"sliding_window is Mistral's (architecture: mistral), not {self.architecture}'s")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("sliding_window must be at least 1")
        return self


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


# The family formats (`build_family_tokenizer`): special tokens in vocabulary order, then what plays each role.
# Qwen2/Qwen3: byte-level BPE, no BOS, ChatML turns (`<|im_start|>role ... <|im_end|>`), the instruct models'
# EOS `<|im_end|>`, `<|endoftext|>` padding. Llama 3: byte-level BPE, `<|begin_of_text|>` prepended, header
# turns ending in `<|eot_id|>`. Mistral: SentencePiece-style BPE (`▁` for spaces, digits one by one, no byte
# fallback here: a character outside printable ASCII is `<unk>`), `<s>` prepended, `[INST] ... [/INST]` turns,
# `</s>` ending a reply, `<unk>` padding (Mistral has no pad token).
_QWEN = {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos": None, "eos": "<|im_end|>",
         "pad": "<|endoftext|>", "unk": None, "byte_level": True,
         "chat_template": (
             "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
             "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")}
FAMILY_TOKENIZERS = {
    "qwen2": _QWEN,
    "qwen3": _QWEN,
    "llama": {"special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eot_id|>", "<|finetune_right_pad_id|>"],
              "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|finetune_right_pad_id|>", "unk": None,
              "byte_level": True,
              "chat_template": (
                  "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
                  " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
                  "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")},
    "mistral": {"special": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "bos": "<s>", "eos": "</s>",
                "pad": "<unk>", "unk": "<unk>", "byte_level": False,
                "chat_template": (
                    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content']"
                    " + ' [/INST]' }}{% else %}{{ message['content'] + '</s>' }}{% endif %}{% endfor %}")},
}
# What the family tokenizers are trained on: the max-digit task's prompt form and GSM8K's, so both tokenize in
# a few dozen merges; every other text still encodes (byte-level: any byte; SentencePiece-style: printable ASCII).
_CORPUS = [f"max {' '.join(str((i * 7 + k * 3) % 10) for k in range(n))} ?" for i in range(10) for n in (3, 4)] + [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    'Let\'s think step by step and output the final answer after "####".',
    "She sold 48 / 2 = 24 clips in May. Altogether she sold 48 + 24 = 72 clips. #### 72",
]


def build_family_tokenizer(architecture: str, vocab_size: int = 400):
    """A BPE tokenizer in the format of ``architecture``'s family (`FAMILY_TOKENIZERS`), trained here on a small
    corpus and saved as the real models' are (tokenizer.json, tokenizer_config.json with the chat template), so
    `AutoTokenizer` loads it, `apply_chat_template` renders with it and the EOS/pad/BOS roles are the family's."""
    fam = FAMILY_TOKENIZERS[architecture]
    tok = Tokenizer(BPE(unk_token=fam["unk"]))
    if fam["byte_level"]:
        # the GPT-2 style split with digits one by one (Qwen's), then bytes mapped to printable characters
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+| ?\p{L}+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([  # SentencePiece's split_digits, as Mistral's
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"),
            pre_tokenizers.Digits(individual_digits=True)])
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        alphabet = [chr(c) for c in range(32, 127)] + ["\u2581"]
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=fam["special"], initial_alphabet=alphabet,
                         show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    if fam["bos"]:
        bos = tok.token_to_id(fam["bos"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam['bos']} $A", pair=f"{fam['bos']} $A $B", special_tokens=[(fam["bos"], bos)])
    elif fam["byte_level"]:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    roles = {f"{role}_token": fam[role] for role in ("bos", "eos", "pad", "unk") if fam[role]}
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=fam["chat_template"], padding_side="left",
                                   additional_special_tokens=[t for t in fam["special"] if t not in roles.values()],
                                   **roles)


@contextlib.contextmanager
def progress_bars_off() -> Iterator[None]:
    """Transformers' progress bars off for a block, as they were after it: a command's terminal shows its own lines
    (a save's "Writing model shards" bar of one shard, a load's bars), a caller's own setting stays."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


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

    tokenizer = build_char_tokenizer() if spec.tokenizer == "char" else build_family_tokenizer(spec.architecture)
    config_class, model_class = ARCHITECTURES[spec.architecture]
    extra = {k: v for k, v in (("head_dim", spec.head_dim), ("sliding_window", spec.sliding_window)) if v is not None}
    if spec.architecture == "mistral":
        extra.setdefault("sliding_window", None)  # MistralConfig's own default is 4096
    config = config_class(
        **extra,
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
    if spec.warm_start:
        # minutes on a CPU, once: the terminal says why nothing else happens meanwhile
        print(f"chatlearn: building the tiny model at {path} with the {spec.warm_start!r} warm start (once; a few "
              "minutes on two cores)", file=sys.stderr, flush=True)
        started = time.monotonic()
        import_callable(WARM_STARTS[spec.warm_start])(model, tokenizer, seed=spec.seed)
        print(f"chatlearn: warm start done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        with progress_bars_off():  # built in the driver of a user's first run, before anything is on its terminal
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
