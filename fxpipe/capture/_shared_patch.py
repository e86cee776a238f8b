"""torch's functions and ``torch.Tensor``'s attributes wrapped while any capture watches them.

Several recordings of a capture watch what the model's code does by wrapping torch for the
duration of a trace: the number conversions of ``Tensor`` (:mod:`._trace_time`), the context
functions and ``dtype`` / ``requires_grad`` / ``register_hook`` (:mod:`._call_context`). Builds may
run in threads, so each wrapping is shared: the first session installs it, the last puts the
originals back (an attribute the class did not have of its own is deleted again), and the
wrappers hand what they see to the sessions active then, which keep only their own thread's.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, List, Tuple, TypeVar

__all__ = ["SharedPatch"]

Session = TypeVar("Session")
_MISSING = object()


class SharedPatch(Generic[Session]):
    """``replacements()`` -- ``(owner, name, new value)`` triples, made when the first session
    enters -- set while any session is active; :attr:`sessions` lists them, first first."""

    def __init__(self, replacements: Callable[[], List[Tuple[Any, str, Any]]]) -> None:
        self._replacements = replacements
        self._lock = threading.Lock()
        self._saved: List[Tuple[Any, str, Any]] = []
        self.sessions: List[Session] = []

    def enter(self, session: Session) -> None:
        with self._lock:
            if not self.sessions:
                for owner, name, value in self._replacements():
                    self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
                    setattr(owner, name, value)
            self.sessions.append(session)

    def exit(self, session: Session) -> None:
        with self._lock:
            self.sessions.remove(session)
            if not self.sessions:
                for owner, name, value in reversed(self._saved):
                    if value is _MISSING:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, value)
                self._saved.clear()
