"""The error of a data file that cannot be used (every reader's: JSONL/JSON, tables, chat messages)."""

from chatlearn.utils.errors import UserError


class DataError(UserError, ValueError):
    """A prompt file that cannot be used; the message names the file (and line or row)."""
