"""Models and data checked before anything starts: model paths, prompt files, prompt lengths.

`chatlearn train` used to find a typo in `model_path`, a non-UTF-8 line or a prompt too long for the model
only after the Prefect server, Ray and a flow run were up, as a traceback from an actor. :func:`preflight`
runs the same checks on the driver first, once per run, when the entry point prepares the run
(`chatlearn.runtime.prepared`: before `chatlearn train`/`eval` start the Prefect server, before a flow claims
the run directory; `launch` takes the records from the prepared run), and reports:

* a model file problem as a :class:`~chatlearn.config.ConfigError` naming ``models.<name>.args_dict.<field>``
  (from each module's ``check_files``: the built-in Hugging Face modules check ``model_path`` and build the
  embedded tiny model where ``model_path`` is ``args_dict.tiny_model_path``);
* a data problem as a :class:`~chatlearn.data.prompts.DataError` naming the file and line;
* a prompt longer than the producer's context (``max_position_embeddings`` of its ``model_path`` config)
  minus what is generated after it (``max_new_tokens``; a DPO pair's longer response and EOS) as a
  DataError naming the file and line, or cut to fit, keeping its end, where the producer's
  ``args_dict.truncate_long_prompts`` is true;
* the same for every model that reads prompt+response as text under its own tokenizer (``reads_text``: a
  reward model of another ``model_path``), against its own context, the prompt counted by its tokenizer, with
  the producer's reserve for the response (its ``max_new_tokens``, as the policy counts them: a reward
  tokenizer that splits text finer may still see a longer response). Without it, a reward model with a
  shorter context or a finer tokenizer than the policy's fails, or scores past its positions, only once a
  batch reaches it. A cut prompt fits all of them.

Neither Ray nor Prefect is imported here.
"""

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from chatlearn.config import ChatLearnConfig, ConfigError
from chatlearn.data.chat import ChatTemplate, is_chat, message_problem
from chatlearn.data.prompts import DataError
from chatlearn.data.records import Records, read_records

__all__ = ["PreparedData", "preflight", "record_keys"]

logger = logging.getLogger("chatlearn")

# config.json fields that hold a model's context length, in the order Hugging Face's families use them
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


class _Plan(Protocol):
    producer: str
    environment: Any


class _Engine(Protocol):
    """What the preflight reads of `chatlearn.runtime.plan.ResolvedEngine` (a layer above this one)."""

    @property
    def name(self) -> str: ...
    @property
    def modules(self) -> Mapping[str, Any]: ...
    @property
    def plan(self) -> _Plan: ...
    @property
    def dataset(self) -> Sequence[Any] | None: ...
    @property
    def eval_dataset(self) -> Sequence[Any] | None: ...


class PreparedData(NamedTuple):
    """The records a run uses, checked (and cut to fit where the config says so), read lazily."""

    prompts: Records
    eval_prompts: Records


class _Budget(NamedTuple):
    """How long a prompt may be: a model's tokenizer and context (the producer's, or a text reader's), what
    follows the prompt (always the producer's reserve)."""

    tokenizer: Any
    context: int
    source: str  # where the context comes from, for messages
    max_new_tokens: int | None  # a generating producer's reserve; None: a pair reader (its responses)
    response_keys: tuple[str, ...]
    max_response_tokens: int | None
    truncate: bool
    owner: str  # "models.<producer>.args_dict": where truncate_long_prompts is set
    whose: str = "the model's"  # whose context, for messages: the producer's, or "models.reward's"


def record_keys(producer: Any, args: Mapping[str, Any]) -> list[str]:
    """The string fields every data record must hold for the producer: its prompt (``prompt_key``), and a
    DPO pair's two responses (``chosen_key``, ``rejected_key``) when the producer reads pairs."""
    keys = [args.get("prompt_key", "prompt")]
    fields = getattr(producer.args_schema, "model_fields", {}) if getattr(producer, "args_schema", None) else {}
    for name in ("chosen_key", "rejected_key"):
        if name in fields:
            keys.append(args.get(name, fields[name].default))
    return keys


def preflight(cfg: ChatLearnConfig, eng: _Engine) -> PreparedData:
    """Check the engine's model files and the run's data; returns the records `launch` hands the producer.

    Raises ConfigError (every model file problem, as dotted paths) or DataError (the first bad record, by file
    and line). Builds the embedded tiny model where the config asks for it. Called once per run, by
    `chatlearn.runtime.prepared.prepare_run`.
    """
    check_model_files(cfg, eng.modules)
    return _prepare_data(cfg, eng)


def check_model_files(cfg: ChatLearnConfig, modules: Mapping[str, Any]) -> None:
    """ConfigError listing what every module's ``check_files`` finds wrong (modules without one: nothing)."""
    problems: list[str] = []
    for name, module in modules.items():
        check = getattr(module, "check_files", None)
        if check is None or name not in cfg.models:
            continue  # a module given in code only has no args_dict to check
        problems += [f"models.{name}.{p}" for p in check(cfg.models[name])]
    if problems:
        raise ConfigError(problems)


def _given(records: Sequence[Any], keys: list[str], where: str) -> Records:
    """Records given in code (ChatLearn's ``set_dataset``): dicts holding ``keys`` (the prompt may be chat
    messages), or prompt strings."""
    placed = []
    for i, rec in enumerate(records):
        rec = {keys[0]: rec} if isinstance(rec, str) else rec
        good = isinstance(rec, dict) and all(
            isinstance(rec.get(k), str) or (k == keys[0] and is_chat(rec.get(k)) and not message_problem(rec.get(k)))
            for k in keys)
        if not good:
            raise DataError(f"{where}: record {i} is {type(rec).__name__}; expected a prompt string or a dict whose "
                            f"{keys} are strings")
        placed.append((f"{where}: record {i}", rec))
    return Records.of(placed)


def _files(cfg: ChatLearnConfig, eng: _Engine) -> tuple[list[str], list[str]]:
    """The train and eval files the run reads ([] where it reads none, or the engine was given its records)."""
    rt = cfg.runtime
    with_train_data = eng.plan.environment is not None and eng.dataset is None
    wants_eval = rt.eval_episode_interval or rt.enable_eval_before_training or eng.plan.environment is None
    train = _as_list(rt.data_path) if with_train_data else []
    evals = _as_list(rt.eval_data_path) if rt.eval_data_path and wants_eval else []
    return train, evals


def _as_list(paths: str | Sequence[str] | None) -> list[str]:
    """`runtime.data_path` is one path or a list (ChatLearn takes both)."""
    if not paths:
        return []
    return [str(paths)] if isinstance(paths, str | os.PathLike) else [str(p) for p in paths]


def _prepare_data(cfg: ChatLearnConfig, eng: _Engine) -> PreparedData:
    """The run's records as `launch` hands them on (same files, same required fields), read lazily, chat
    prompts rendered with the producer's tokenizer, measured against the producer's context while their places
    are still known."""
    producer = eng.plan.producer
    module = eng.modules[producer]
    args = (cfg.models[producer].args_dict if producer in cfg.models else None) or {}
    keys = record_keys(module, args)
    train, evals = _files(cfg, eng)
    records = (_given(eng.dataset, keys, "engine.set_dataset") if eng.dataset is not None
               else read_records(train, keys, keys[0]) if train else Records([]))
    eval_records = (_given(eng.eval_dataset, keys, "evaluator.set_dataset") if eng.eval_dataset is not None
                    else read_records(evals, keys, keys[0]) if evals else Records([]))
    budget = _budget(cfg, producer, module) if records or eval_records else None
    chat = _chat_template(cfg, producer, module, budget, [records, eval_records], keys[0])
    if chat is not None:
        records, eval_records = records.with_chat(keys[0], chat), eval_records.with_chat(keys[0], chat)
    if budget is not None:
        budgets = [budget, *_reader_budgets(cfg, eng, budget)]
        records = _fit_all(records, keys[0], budgets)
        eval_records = _fit_all(eval_records, keys[0], budgets)
    return PreparedData(records, eval_records)


def _chat_template(cfg: ChatLearnConfig, producer: str, module: Any, budget: _Budget | None,
                   records: list[Records], key: str) -> ChatTemplate | None:
    """The producer's chat template where a prompt is chat messages (None: none is); a DataError naming the
    first such prompt when the producer has no tokenizer with a template."""
    where = next(filter(None, (r.first_chat(key) for r in records)), None)
    if where is None:
        return None
    owner = f"models.{producer}.args_dict"
    _, path = _model_path(cfg, producer, module)
    if not path:
        raise DataError(f"{where}: the prompt is a list of chat messages, and models.{producer} has no model_path "
                        "whose tokenizer's chat template could render it; give the prompt as text")
    if budget is not None:
        tokenizer = budget.tokenizer
    else:
        from transformers import AutoTokenizer  # a chat template without a budget: the producer's tokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{owner}.model_path: cannot load the tokenizer of {path!r}: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    chat = ChatTemplate(tokenizer, str(path), owner)
    chat.check(where)
    return chat


def _fit_all(records: Records, prompt_key: str, budgets: list[_Budget]) -> Records:
    """`_fit` for every budget, until none cuts anything: a prompt cut to fit one tokenizer may, rarely,
    count longer under another after the cut (each cut only shortens, so this ends)."""
    while True:
        cut_any = False
        for budget in budgets:
            records, cut = _fit(records, prompt_key, budget)
            cut_any = cut_any or cut
        if not cut_any or len(budgets) == 1:  # one budget: `_keep_end` checked its own cuts
            return records


def _model_path(cfg: ChatLearnConfig, name: str, module: Any) -> tuple[Any, str | None]:
    """A module's validated args and its ``model_path`` (None: it has none, or no args schema)."""
    schema = getattr(module, "args_schema", None)
    if schema is None or "model_path" not in getattr(schema, "model_fields", {}) or name not in cfg.models:
        return None, None
    args = schema.model_validate(cfg.models[name].args_dict or {})
    return args, getattr(args, "model_path", None)


def _context(path: str, owner: str) -> tuple[Any, int, str] | None:
    """The tokenizer of ``path``, its context length and where that comes from; None: its config names none."""
    # transformers on demand: `chatlearn config` and the other commands that import this module stay fast
    from transformers import AutoConfig, AutoTokenizer

    try:
        model_config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{owner}.model_path: cannot load the model config and tokenizer of {path!r}: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    found = [(f, getattr(model_config, f, None)) for f in _CONTEXT_FIELDS]
    found = [(f, v) for f, v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if not found:
        return None
    field, context = found[0]
    return tokenizer, context, f"{field} of {os.path.join(str(path), 'config.json')}"


def _reader_budgets(cfg: ChatLearnConfig, eng: _Engine, producer_budget: _Budget) -> list[_Budget]:
    """A budget for each other model of the run that reads prompt+response as text under its own tokenizer
    (``reads_text``, e.g. `ModelReward`) from another ``model_path`` than the producer's: its tokenizer and
    context, the producer's reserve for the response and its ``truncate_long_prompts``."""
    producer = eng.plan.producer
    _, producer_path = _model_path(cfg, producer, eng.modules[producer])
    out = []
    for name, module in eng.modules.items():
        if name == producer or not getattr(module, "reads_text", False):
            continue
        _, path = _model_path(cfg, name, module)
        if not path or os.path.realpath(str(path)) == os.path.realpath(str(producer_path)):
            continue  # the producer's own tokenizer and context: measured already
        found = _context(str(path), f"models.{name}.args_dict")
        if found is None:
            continue
        tokenizer, context, source = found
        whose = f"models.{name}'s"
        max_new = producer_budget.max_new_tokens
        if max_new is not None and max_new >= context:
            raise ConfigError(f"{producer_budget.owner}.max_new_tokens: {max_new} leaves no room for a prompt in "
                              f"{whose} context of {context} tokens ({source}), which scores the response")
        out.append(producer_budget._replace(tokenizer=tokenizer, context=context,
                                            source=f"{source}, under its own tokenizer", whose=whose))
    return out


def _budget(cfg: ChatLearnConfig, producer: str, module: Any) -> _Budget | None:
    """The producer's prompt budget, or None where it cannot be known (a module without `model_path`, a model
    config without a context length): then prompts are not measured."""
    args, path = _model_path(cfg, producer, module)
    fields = getattr(module.args_schema, "model_fields", {}) if args is not None else {}
    generates = "max_new_tokens" in fields
    pairs = "chosen_key" in fields and "rejected_key" in fields
    if not path or not (generates or pairs):
        return None
    owner = f"models.{producer}.args_dict"
    found = _context(path, owner)
    if found is None:
        return None
    tokenizer, context, source = found
    max_new = int(args.max_new_tokens) if generates else None
    if max_new is not None and max_new >= context:
        raise ConfigError(f"{owner}.max_new_tokens: {max_new} leaves no room for a prompt in the model's "
                          f"context of {context} tokens ({source})")
    return _Budget(tokenizer, context, source, max_new,
                   (args.chosen_key, args.rejected_key) if pairs and not generates else (),
                   getattr(args, "max_response_tokens", None) if pairs and not generates else None,
                   bool(getattr(args, "truncate_long_prompts", False)), owner)


def _fit(records: Records, prompt_key: str, budget: _Budget) -> tuple[Records, bool]:
    """The records, every prompt fitting the budget: one that does not is an error naming the first (and how
    many), or cut to fit (`truncate_long_prompts`; then True). Only the prompts that may not fit by their UTF-8
    length are tokenized (`_suspects`), so a file of a million records is measured in seconds."""
    if not len(records):
        return records, False
    tok = budget.tokenizer
    over: list[tuple[int, int, int]] = []  # (row, prompt tokens, tokens after it) of each prompt too long
    for rows in _suspects(records, prompt_key, budget):
        placed = [(records.place(i), records[i]) for i in rows]
        lengths = [len(ids) for ids in tok([rec[prompt_key] for _, rec in placed])["input_ids"]]
        reserves = _reserves(placed, budget)
        over += [(i, n, r) for i, n, r in zip(rows, lengths, reserves, strict=True) if n + r > budget.context]
    if not over:
        return records, False
    if not budget.truncate:
        i, n, reserve = over[0]
        more = f"; {len(over) - 1} more prompt(s) too long" if len(over) > 1 else ""
        raise DataError(f"{records.place(i)}: prompt of {n} tokens is longer than the {budget.context - reserve} "
                        f"that fit ({_room(budget, reserve)}){more}; shorten it, or set "
                        f"{budget.owner}.truncate_long_prompts=true to cut long prompts to fit (keeping their end)")
    cuts = {}
    for i, _, reserve in over:
        cut = _keep_end(tok, records[i][prompt_key], budget.context - reserve)
        if cut is None:
            raise DataError(f"{records.place(i)}: no part of the prompt fits in {_room(budget, reserve)}")
        cuts[i] = cut
    logger.warning("cut %d prompt(s) longer than the model's context allows to fit, keeping their end "
                   "(truncate_long_prompts); the first: %s", len(over), records.place(over[0][0]))
    return records.with_cuts(prompt_key, cuts), True


# prompts tokenized to check that the tokenizer never makes more tokens than a text has UTF-8 bytes (plus its
# special tokens and one word-start marker), the bound `_suspects` relies on
_BOUND_SAMPLE = 1024


def _suspects(records: Records, prompt_key: str, budget: _Budget) -> Iterator[list[int]]:
    """The rows, in order and in batches, whose prompt may be too long or whose response may exceed
    max_response_tokens: those whose UTF-8 lengths (from Arrow, no tokenizer) would not fit if every byte were
    a token. Byte-level BPE, SentencePiece with byte fallback and WordPiece never make more; a tokenizer that
    does on the first `_BOUND_SAMPLE` records gets every row measured instead."""
    slack = len(budget.tokenizer("")["input_ids"]) + 1  # BOS and the like, and a word-start marker ("▁")
    every = not _bound_holds(records, prompt_key, budget, slack)
    streams = [records.text_bytes(prompt_key), *(records.text_bytes(k) for k in budget.response_keys)]
    start = 0
    for prompt_bytes, *responses in zip(*streams, strict=True):
        if every:
            rows = np.arange(len(prompt_bytes))
        else:
            longest = np.maximum.reduce(responses) + 2 if responses else None  # + the marker and EOS
            reserve = budget.max_new_tokens if budget.max_new_tokens is not None else longest
            suspect = prompt_bytes + slack + reserve > budget.context
            if longest is not None and budget.max_response_tokens is not None:
                suspect |= longest > budget.max_response_tokens
            rows = np.flatnonzero(suspect)
        if len(rows):
            yield (rows + start).tolist()
        start += len(prompt_bytes)


def _bound_holds(records: Records, prompt_key: str, budget: _Budget, slack: int) -> bool:
    """Whether the first records' texts tokenize to at most their UTF-8 length plus ``slack`` (responses: plus
    one) tokens."""
    sample = records[:_BOUND_SAMPLE]
    tok = budget.tokenizer
    for key, extra, special in [(prompt_key, slack, True), *((k, 1, False) for k in budget.response_keys)]:
        texts = [rec[key] for rec in sample]
        for text, ids in zip(texts, tok(texts, add_special_tokens=special)["input_ids"], strict=True):
            if len(ids) > len(text.encode("utf-8")) + extra:
                logger.info("the tokenizer of %s makes more tokens than a text has bytes: every prompt is measured",
                            budget.source)
                return False
    return True


def _room(budget: _Budget, reserve: int) -> str:
    """How the room for a prompt is made up, for messages."""
    after = (f"max_new_tokens {budget.max_new_tokens}" if budget.max_new_tokens is not None
             else f"its longer response and EOS, {reserve} tokens")
    return f"{budget.whose} context of {budget.context} tokens, {budget.source}, minus {after}"


def _reserves(placed: list[tuple[str, dict[str, Any]]], budget: _Budget) -> list[int]:
    """Tokens that follow each prompt: max_new_tokens, or a pair's longer response plus EOS (each response
    checked against max_response_tokens here, as the pair reader does later, so the error names the line)."""
    if budget.max_new_tokens is not None:
        return [budget.max_new_tokens] * len(placed)
    tok = budget.tokenizer
    longest = [0] * len(placed)
    for key in budget.response_keys:
        rows = tok([rec[key] for _, rec in placed], add_special_tokens=False)["input_ids"]
        for i, ids in enumerate(rows):
            n = len(ids) + 1  # the pair reader appends EOS
            if budget.max_response_tokens is not None and n > budget.max_response_tokens:
                raise DataError(f"{placed[i][0]}: field {key!r} is {n} tokens with EOS, more than "
                                f"{budget.owner}.max_response_tokens ({budget.max_response_tokens})")
            longest[i] = max(longest[i], n)
    return longest


def _keep_end(tok: Any, text: str, limit: int) -> str | None:
    """The shortest end of `text` cut at a token boundary whose tokens (special ones included) are at most
    `limit`, or None when not one content token fits. Re-tokenised to check: a cut can merge differently."""
    room = limit - len(tok("")["input_ids"])  # BOS and the like
    if room <= 0:
        return None
    fast = getattr(tok, "is_fast", False)
    if fast:  # cut the text itself at a token's first character: nothing is decoded, nothing altered
        marks = [a for a, _ in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    else:
        marks = tok(text, add_special_tokens=False)["input_ids"]
    keep = min(room, len(marks))
    while keep > 0:
        cut = text[marks[len(marks) - keep]:] if fast else tok.decode(marks[len(marks) - keep:])
        excess = len(tok(cut)["input_ids"]) - limit
        if excess <= 0:
            return cut
        keep -= excess
    return None
