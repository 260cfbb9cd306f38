"""Exit codes and the one error type for everything a user can fix: bad config, bad input, impossible request."""
from __future__ import annotations

EXIT_OK = 0  # every run passed every gate: may ship
EXIT_GATE_FAILED = 1  # a gate (or the checkpoint audit) failed
EXIT_BAD_INPUT = 2  # bad config or input: the message names the fix
EXIT_INTERNAL = 3  # a bug of ours: the traceback is kept in the run directory
EXIT_INTERRUPTED = 130  # Ctrl-C: finished artifacts are kept, a rerun resumes


class QuantlabError(Exception):
    """A problem the user can fix. The message says what is wrong and what to do about it."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, fix: str | None = None):
        self.problem = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message}\n  fix: {fix}")
