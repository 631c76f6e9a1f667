"""An observation's tokens as the policy's chat template renders them after its answer.

A policy's answer ends with the tokenizer's EOS, as generated (ChatML's ``<|im_end|>``, Llama 3's
``<|eot_id|>``, Mistral's ``</s>``). What follows in the template's own rendering of the conversation is the
rest of that message (e.g. ChatML's newline), the observation as a tool message, and the next assistant turn's
header: those tokens are appended, so the conversation the policy continues from is the one the template would
render. The suffix is found by rendering a conversation with and without the observation and cutting after the
answer's EOS; it starts after a special token, so tokenizing it alone gives the tokens the whole conversation
has there (no BPE merge crosses a special token).

A template that renders no distinct tool role (Mistral's, where any non-user message is an answer) or refuses
one gets the observation as a user message holding ``<tool_response>...</tool_response>``. An observation made
of several ``<tool_response>`` blocks (`ToolEnvironment` with several calls in one answer) is rendered as that
many tool messages, as the template renders the results of several calls.

A tokenizer with no chat template (the embedded char tokenizer) gets the plain format: the observation between
two newlines, or between two spaces where the vocabulary has no newline (the char tokenizer's has none).
"""

import functools
import re
from collections.abc import Callable
from typing import Any

from chatlearn.tools.calls import RESPONSE_CLOSE, RESPONSE_OPEN, render_tool_response

__all__ = ["ObservationRenderer", "renderer_for", "split_tool_responses"]

_PROBE = "PROBE"  # a message body no template adds itself
_BLOCK = re.compile(re.escape(RESPONSE_OPEN) + r"\n(.*?)\n" + re.escape(RESPONSE_CLOSE), re.DOTALL)


def split_tool_responses(text: str) -> list[str] | None:
    """The results of a text that is exactly several ``<tool_response>`` blocks joined by newlines (as
    `render_tool_response` writes each), else None (one plain observation)."""
    if not text.startswith(RESPONSE_OPEN):
        return None
    parts, pos = [], 0
    while pos < len(text):
        match = _BLOCK.match(text, pos)
        if match is None:
            return None
        parts.append(match.group(1))
        pos = match.end()
        if pos < len(text):
            if text[pos] != "\n":
                return None
            pos += 1
    return parts if len(parts) > 1 else None


class ObservationRenderer:
    """Turns an observation's text into the token ids appended after a policy's answer (its EOS included)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.role = self._tool_role() if self.templated else None
        self.separator = "\n" if self.templated or self._encodes("\n") else " "

    def _encodes(self, text: str) -> bool:
        unk = self.tokenizer.unk_token_id
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return bool(ids) and (unk is None or unk not in ids)

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _tool_role(self) -> str:
        """"tool" where the template renders a tool message apart from an answer, else "user"."""
        try:
            tool = self._render([{"role": "user", "content": "q"}, {"role": "tool", "content": _PROBE}], False)
            answer = self._render([{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}], False)
        except Exception:  # noqa: BLE001 - a template that refuses the role (raise_exception) has no tool turn
            return "user"
        return "tool" if tool != answer else "user"

    def messages(self, text: str) -> list[dict[str, str]]:
        """The chat messages the observation ``text`` is rendered as (templated tokenizers only)."""
        results = split_tool_responses(text)
        if self.role == "tool":
            return [{"role": "tool", "content": r} for r in (results or [text])]
        # no tool role: one user turn holding the result(s) as the tool-calling format writes them
        return [{"role": "user", "content": text if results else render_tool_response(text)}]

    def text(self, text: str) -> str:
        """The text after an answer's EOS: the observation ``text`` and the next answer's header."""
        if not self.templated:
            return self.separator + text + self.separator
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        head = self._render(base, False)
        full = self._render([*base, *self.messages(text)], True)
        eos = self.tokenizer.eos_token
        cut = head.rfind(eos) if eos else -1
        if cut < 0 or not full.startswith(head[:cut + len(eos)]):
            raise ValueError(f"the chat template of {getattr(self.tokenizer, 'name_or_path', 'the tokenizer')} does "
                             f"not end an answer with its EOS {eos!r}: observations cannot follow the answer's tokens")
        return full[cut + len(eos):]

    def ids(self, text: str) -> list[int]:
        """The token ids after an answer's EOS: the observation ``text`` and the next answer's header."""
        return self.tokenizer(self.text(text), add_special_tokens=False)["input_ids"]


@functools.lru_cache(maxsize=4)
def renderer_for(model_path: str, load_tokenizer: Callable[[str], Any]) -> "ObservationRenderer":
    """The renderer of the policy's tokenizer at ``model_path`` (loaded by ``load_tokenizer``), made once per
    process: an ``env-step`` task's Ray worker steps many batches."""
    return ObservationRenderer(load_tokenizer(model_path))
