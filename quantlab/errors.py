"""One error type for everything a user can fix: bad config, bad input, impossible request."""
from __future__ import annotations

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2


class QuantlabError(Exception):
    """A problem the user can fix. The message says what is wrong and what to do about it."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, fix: str | None = None):
        self.problem = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message}\n  fix: {fix}")
