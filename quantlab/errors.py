"""Exit codes and the one error type for everything a user can fix: bad config, bad input, impossible request."""
from __future__ import annotations

EXIT_OK = 0  # every run passed every gate: may ship
EXIT_GATE_FAILED = 1  # a gate (or the checkpoint audit) failed
EXIT_BAD_INPUT = 2  # bad config or input: the message names the fix
EXIT_INTERNAL = 3  # a bug of ours: the traceback is kept in the run directory
EXIT_INTERRUPTED = 130  # Ctrl-C: finished artifacts are kept, a rerun resumes
EXIT_TERMINATED = 143  # SIGTERM while a started server lived (engine=served): stopped like Ctrl-C


class QuantlabError(Exception):
    """A problem the user can fix. The message says what is wrong and what to do about it."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, fix: str | None = None):
        self.problem = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message}\n  fix: {fix}")


def cli_guard(main, argv=None, *, interrupted: str = "quantlab: interrupted", traceback_file: str | None = None) -> int:
    """Run an auxiliary CLI's main(argv) under the main CLI's exit-code contract: a QuantlabError is one paragraph
    and exit 2, Ctrl-C one line (`interrupted`) and exit 130, a bug one line and exit 3 (never a traceback wall; with
    `traceback_file`, a name in the temp directory, the traceback is kept there and the line names it)."""
    import sys

    try:
        return main(argv)
    except QuantlabError as exc:
        print(f"quantlab: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the type and message
        where = ""
        if traceback_file:
            import tempfile
            import traceback
            from pathlib import Path

            trace = Path(tempfile.gettempdir()) / traceback_file
            trace.write_text(traceback.format_exc())
            where = f"\n  traceback: {trace}"
        print(f"quantlab: internal error: {type(exc).__name__}: {exc}{where}", file=sys.stderr)
        return EXIT_INTERNAL
