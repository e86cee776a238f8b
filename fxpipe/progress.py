"""What fxpipe is doing while it runs: log records, a build's progress bar, a status line.

A big model's build takes tens of seconds (capture, the checks that run the model, the
profile), and a silent minute looks like a hang. Each phase is logged at INFO on the
``"fxpipe"`` logger (``logging.basicConfig(level=logging.INFO)`` shows them, with timings),
and while stderr is a terminal one status line shows the phase, a bar over the graph's
nodes where they are counted (profiling), and the seconds spent. torch has no public
progress bar and tqdm is not a dependency, so the bar is these few lines.

Quiet when it should be: nothing is drawn when stderr is not a terminal (piped, redirected,
under pytest), with ``progress=False`` on :func:`fxpipe.pipeline` and the other entry
points, or when the ``"fxpipe"`` logger is set to ``WARNING`` or above
(``logging.getLogger("fxpipe").setLevel(logging.WARNING)``) or disabled, or after
``set_enabled(False)`` (the command line's ``--no-progress``), which turns off the status
lines of the command line and the demo as well (:func:`status_line`).
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TextIO, Union

from .errors import ArgumentError

__all__ = ["logger", "Progress", "ProgressOption", "as_progress", "status_line", "clear_status_line", "set_enabled",
           "enabled"]

#: the logger every fxpipe build reports its phases to
logger = logging.getLogger("fxpipe")

#: what ``progress=`` accepts: ``True`` (the default: a bar on a terminal), ``False``, or a Progress
ProgressOption = Union[bool, "Progress"]

_BAR_WIDTH = 24
_enabled = True  # this process's switch (--no-progress): bars and status lines
_REDRAW_S = 0.1  # at most this often: drawing must not cost what it reports


def _silenced() -> bool:
    """Turned off for the process, or the ``"fxpipe"`` logger set to WARNING or above (its
    own level, not the root's), or disabled."""
    return not _enabled or logger.disabled or logger.level >= logging.WARNING


def set_enabled(on: bool) -> None:
    """Bars and status lines on (the default) or off, for this process (``--no-progress``)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    """Whether bars and status lines are wanted (they still need a terminal)."""
    return _enabled


def _terminal() -> Optional[TextIO]:
    stream = sys.stderr
    try:
        return stream if _enabled and stream.isatty() else None
    except (AttributeError, ValueError):  # closed or not a file
        return None


def status_line(message: str, *, done: bool = False) -> None:
    """One status line on a terminal's stderr while something slow runs (a command's step,
    the demo); nothing when stderr is piped or redirected, so logs and tests see only the
    real output. ``done`` ends the line."""
    out = _terminal()
    if out is not None:
        out.write("\r\033[K" + message + ("\n" if done else ""))
        out.flush()


def clear_status_line() -> None:
    """Erases the status line (on a terminal)."""
    out = _terminal()
    if out is not None:
        out.write("\r\033[K")
        out.flush()


class Progress:
    """Reports the phases of one build: ``with progress.phase("profiling", total=n) as step:``
    logs the start and the seconds it took at INFO, and draws ``step()`` calls as a bar.

    ``enabled=False`` draws nothing (the log records are still written: logging decides).
    ``stream`` is where the bar goes (default ``sys.stderr``); it is drawn only on a terminal.
    """

    def __init__(self, enabled: bool = True, stream: Optional[TextIO] = None) -> None:
        self.enabled = enabled
        self.stream = stream

    def _out(self) -> Optional[TextIO]:
        stream = self.stream if self.stream is not None else sys.stderr
        if not self.enabled or _silenced():
            return None
        try:
            return stream if stream.isatty() else None
        except (AttributeError, ValueError):  # closed or not a file
            return None

    @contextmanager
    def phase(self, name: str, total: Optional[int] = None) -> Iterator[Callable[[], None]]:
        """A named phase; the callable it yields counts one of ``total`` units done."""
        out = self._out()
        start = time.perf_counter()
        done = 0
        last = 0.0
        logger.info("fxpipe: %s ...", name)

        def draw(force: bool = False) -> None:
            nonlocal last
            now = time.perf_counter()
            if out is None or (not force and now - last < _REDRAW_S):
                return
            last = now
            text = f"fxpipe: {name}"
            if total:
                filled = min(_BAR_WIDTH, _BAR_WIDTH * done // total)
                text += f" [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done}/{total}"
            out.write(f"\r\033[K{text}  {now - start:.1f}s")
            out.flush()

        def step() -> None:
            nonlocal done
            done += 1
            draw()

        draw(force=True)
        try:
            yield step
        finally:
            if out is not None:
                out.write("\r\033[K")
                out.flush()
            logger.info("fxpipe: %s took %.2fs", name, time.perf_counter() - start)


def as_progress(option: ProgressOption) -> Progress:
    """A :class:`Progress` from a ``progress=`` argument; :class:`~fxpipe.errors.ArgumentError`
    for anything else."""
    if isinstance(option, Progress):
        return option
    if isinstance(option, bool):
        return Progress(enabled=option)
    raise ArgumentError(f"progress must be True (a progress bar on a terminal), False (none) or an "
                        f"fxpipe.progress.Progress, got progress={option!r}", argument="progress")
