"""What every config section shares: ChatLearn's ``get(key)`` for the keys it keeps as user extras.

Unknown keys, section by section, as ChatLearn 1.0.2 treats them (every message names the nearest known key
when one is close: "did you mean num_episode?"):

* top level: ignored (ChatLearn ignores them); a :class:`~chatlearn.config.errors.ConfigWarning` each.
* ``runtime`` / ``runtime_env``: kept as user extras, readable with ``get(key)`` (ChatLearn's own configs and
  code add such keys: ``eval_data_num_limit``, ``query_key``, Ray's ``env_vars``); a ConfigWarning only when
  the key looks like a misspelt field (``runtime.num_episodes``), since the field then keeps its default.
* ``models.<name>``: kept (ChatLearn logs "unknown argument"); a ConfigWarning each.
* ``models.<name>.lora`` / ``.batch_generation`` and ``deployment``: errors (ChatLearn raises for the first two;
  the last is ours).
* ``models.<name>.args_dict``: the backend's own keys, free here; the engine's checks
  (:mod:`chatlearn.config.engine_checks`) refuse unknown keys for the built-in modules, whose arguments are
  known (``args_schema``), and leave a user module's ``args_dict`` to it.
"""

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
