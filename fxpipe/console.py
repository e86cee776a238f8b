"""One status line on the terminal while something slow runs (tracing, profiling, a step).

Used by the command line and the demo. Nothing is written when stderr is piped or
redirected, so logs and tests see only the real output.
"""

from __future__ import annotations

import sys

__all__ = ["progress", "clear_progress"]


def progress(message: str, *, done: bool = False) -> None:
    """A status line on a terminal's stderr; nothing when stderr is piped or redirected."""
    stream = sys.stderr
    if not stream.isatty():
        return
    stream.write("\r\033[K" + message + ("\n" if done else ""))
    stream.flush()


def clear_progress() -> None:
    """Erases the status line (on a terminal)."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
