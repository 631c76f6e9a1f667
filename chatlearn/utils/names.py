"""The nearest known name to a misspelt one, for "did you mean X?" in every error that names a key or a name."""

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = ["SUGGEST_CUTOFF", "closest_name", "did_you_mean"]

# How alike a misspelt key and a known name must be (difflib's ratio) for "did you mean X?": low enough for a
# dropped or swapped letter (num_episodes, temprature: 0.95), high enough that an unrelated key gets no guess.
SUGGEST_CUTOFF = 0.7


def closest_name(key: Any, known: Iterable[Any], cutoff: float = SUGGEST_CUTOFF) -> str | None:
    """The known name nearest to a misspelt ``key`` (None when nothing is close, or ``key`` is not text)."""
    if not isinstance(key, str) or not key:
        return None
    names = [k for k in known if isinstance(k, str) and k != key]
    matches = difflib.get_close_matches(key, names, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def did_you_mean(key: Any, known: Iterable[Any], cutoff: float = SUGGEST_CUTOFF) -> str:
    """``"; did you mean X?"`` for the known name nearest to ``key``, else ``""`` (appended to a message)."""
    match = closest_name(key, known, cutoff)
    return f"; did you mean {match}?" if match else ""
