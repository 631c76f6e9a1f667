"""Observation tokens as the chat template renders them."""

from typing import Any


class ObservationRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(" " + text + " ", add_special_tokens=False)["input_ids"]
