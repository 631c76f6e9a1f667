"""Chat-message prompts: a prompt given as ``[{"role": ..., "content": ...}, ...]`` becomes the text the model
reads through its tokenizer's chat template (``apply_chat_template(..., add_generation_prompt=True)``), as
verl and TRL render conversational datasets.

The prompt is rendered where a record is read (`chatlearn.data.records.Records`), so every later reader (the
policy's tokenizer, the prompt-length check, ranking, rewards) sees the same text.
"""

from collections.abc import Mapping
from typing import Any

from chatlearn.data.errors import DataError

__all__ = ["ChatTemplate", "is_chat", "message_problem"]


def is_chat(value: Any) -> bool:
    """Whether a prompt value is given as chat messages (a list) rather than text."""
    return isinstance(value, list | tuple)


def message_problem(value: Any) -> str | None:
    """Why ``value`` is not a list of chat messages (None: it is one): a non-empty list of objects, each with
    string ``role`` and ``content`` (other fields, e.g. ``tool_calls``, go to the template as given)."""
    if not is_chat(value) or not value:
        return "an empty list of chat messages" if is_chat(value) else f"a {type(value).__name__}"
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            return f"a list whose message {i} is a {type(msg).__name__}, not a {{role, content}} object"
        for field in ("role", "content"):
            if not isinstance(msg.get(field), str):
                found = "missing" if msg.get(field) is None else f"a {type(msg.get(field)).__name__}"
                return f"a list whose message {i} has {field!r} {found}, not a string"
    return None


class ChatTemplate:
    """Renders chat-message prompts with one model's tokenizer. Pickled with its tokenizer (a few MB at most), so
    a Ray actor renders exactly as the driver measured."""

    def __init__(self, tokenizer: Any, model_path: str, owner: str) -> None:
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        self.owner = owner  # "models.<name>.args_dict", for messages

    def check(self, where: str) -> None:
        """A DataError at ``where`` (the first chat prompt) when the tokenizer has no chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(f"{where}: the prompt is a list of chat messages, and the tokenizer of {self.model_path} "
                            f"({self.owner}.model_path) has no chat template to render it; give the prompt as text, "
                            "or use a model whose tokenizer_config.json (or chat_template.jinja) holds one")

    def render(self, messages: Any, where: str) -> str:
        """The prompt text of ``messages``; a DataError at ``where`` when they are malformed or the template
        refuses them (e.g. roles that do not alternate)."""
        problem = message_problem(messages)
        if problem is not None:
            raise DataError(f"{where}: the chat prompt is {problem}")
        self.check(where)
        try:
            # a field other rows of an Arrow column have reads as None here: absent, as in the JSON it came from
            conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own raise_exception(...) and Jinja errors alike
            raise DataError(f"{where}: the chat template of {self.model_path} cannot render the prompt: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        if not isinstance(text, str):
            raise DataError(f"{where}: the chat template of {self.model_path} rendered a {type(text).__name__}")
        return text
