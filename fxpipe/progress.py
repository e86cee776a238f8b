"""What a build is doing while it runs: log records and a progress bar on a terminal.

A big model's build takes tens of seconds (capture, the checks that run the model, the
profile), and a silent minute looks like a hang. Each phase is logged at INFO on the
``"fxpipe"`` logger (``logging.basicConfig(level=logging.INFO)`` shows them, with timings),
and while stderr is a terminal one status line shows the phase, a bar over the graph's
nodes where they are counted (profiling), and the seconds spent. torch has no public
progress bar and tqdm is not a dependency, so the bar is these few lines.

Quiet when it should be: nothing is drawn when stderr is not a terminal (piped, redirected,
under pytest), with ``progress=False`` on :func:`fxpipe.pipeline` and the other entry
points, or when the ``"fxpipe"`` logger is set to ``WARNING`` or above
(``logging.getLogger("fxpipe").setLevel(logging.WARNING)``) or disabled.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TextIO, Union

from .errors import ArgumentError

__all__ = ["logger", "Progress", "ProgressOption", "as_progress"]

#: the logger every fxpipe build reports its phases to
logger = logging.getLogger("fxpipe")

#: what ``progress=`` accepts: ``True`` (the default: a bar on a terminal), ``False``, or a Progress
ProgressOption = Union[bool, "Progress"]

_BAR_WIDTH = 24
_REDRAW_S = 0.1  # at most this often: drawing must not cost what it reports


def _silenced() -> bool:
    """The ``"fxpipe"`` logger set to WARNING or above (its own level, not the root's), or disabled."""
    return logger.disabled or logger.level >= logging.WARNING


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
