"""One status line on the terminal while something slow runs (tracing, profiling, a step).

Used by the command line and the demo. Nothing is written when stderr is piped or
redirected, so logs and tests see only the real output, nor after ``set_progress(False)``
(the command line's ``--no-progress``, which also turns off the build's bar,
:mod:`fxpipe.progress`).
"""

from __future__ import annotations

import sys

__all__ = ["progress", "clear_progress", "set_progress", "progress_enabled"]

_enabled = True


def set_progress(enabled: bool) -> None:
    """Status lines on (the default) or off, for this process (``--no-progress``)."""
    global _enabled
    _enabled = bool(enabled)


def progress_enabled() -> bool:
    """Whether status lines and progress bars are wanted (they still need a terminal)."""
    return _enabled


def progress(message: str, *, done: bool = False) -> None:
    """A status line on a terminal's stderr; nothing when stderr is piped or redirected."""
    stream = sys.stderr
    if not _enabled or not stream.isatty():
        return
    stream.write("\r\033[K" + message + ("\n" if done else ""))
    stream.flush()


def clear_progress() -> None:
    """Erases the status line (on a terminal)."""
    if _enabled and sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
