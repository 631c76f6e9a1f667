"""What every config section shares: ChatLearn's ``get(key)`` for the keys it keeps as user extras."""

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    """A config section. ``None`` is accepted only where the field's default is ``None`` (as in ChatLearn,
    whose loader refuses ``num_episode: ${UNSET}``); numbers given for text fields become text."""

    model_config = ConfigDict(protected_namespaces=(), coerce_numbers_to_str=True)

    def get(self, key: str, default: Any = None) -> Any:
        """Value of a known field or of an extra (unknown) key kept from the YAML, else ``default``."""
        if key in type(self).model_fields:
            return getattr(self, key)
        extra = self.__pydantic_extra__ or {}
        return extra.get(key, default)
