"""An autograd Function's ``apply`` replaced while a capture runs, on the capturing thread.

Two parts of the capture must see a ``Function.apply`` call the trace would otherwise run
through: the re-entrant checkpoint (:mod:`._reentrant`, refused) and custom Functions
(:mod:`._custom_functions`, kept whole). Both patch a class's ``apply`` for the duration of a
trace. Captures may overlap (two builds on two threads), so the patch is counted: the
first user installs it, the last puts the class's own ``apply`` back; and what each thread
asked for is thread-local, so another thread calling ``apply`` meanwhile gets torch's own.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Type, TypeVar

__all__ = ["ApplyPatch", "error_in_chain"]

_MISSING = object()
E = TypeVar("E", bound=BaseException)


class ApplyPatch:
    """``cls.apply`` replaced by ``replacement(patch, cls, *args, **kwargs)`` while
    :meth:`active` blocks run; :attr:`state` is what the innermost block on this thread
    gave (``None`` outside any), and :meth:`original` calls the class's own ``apply``."""

    def __init__(self, cls: type, replacement: Callable[..., Any]) -> None:
        self.cls, self.replacement = cls, replacement
        self._lock = threading.Lock()
        self._local = threading.local()
        self._users = 0
        self._saved: Any = _MISSING

    @property
    def state(self) -> Any:
        return getattr(self._local, "state", None)

    def original(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        """The ``apply`` ``cls`` had before the patch, for ``cls`` (a subclass, for a base's patch)."""
        saved = self._saved if self._saved is not _MISSING else None
        if saved is not None:
            return saved.__get__(None, cls)(*args, **kwargs)
        return super(self.cls, cls).apply(*args, **kwargs)  # the class had none of its own

    @contextmanager
    def active(self, state: Any) -> Iterator[None]:
        patch = self

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            return patch.replacement(patch, cls, *args, **kwargs)

        with self._lock:
            if self._users == 0:
                self._saved = self.cls.__dict__.get("apply", _MISSING)
                self.cls.apply = classmethod(apply)  # type: ignore[attr-defined]
            self._users += 1
        outer = self.state
        self._local.state = state
        try:
            yield
        finally:
            self._local.state = outer
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    if self._saved is _MISSING:
                        del self.cls.apply  # type: ignore[attr-defined]
                    else:
                        self.cls.apply = self._saved  # type: ignore[attr-defined]
                    self._saved = _MISSING


def error_in_chain(error: Optional[BaseException], kind: Type[E]) -> Optional[E]:
    """The ``kind`` error behind a capture failure, if any: torch.export may wrap it or chain it."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
