"""Optional recording of pipeline activity, for timelines (Chrome trace, Figure 7 of the paper).

Recording is off unless a :class:`Recorder` is active; the hooks then cost one global read.
Spans are recorded per (kind, partition, micro-batch, device) with wall-clock times:
``forward`` and ``recompute`` (the partition function's runs), ``backward`` (from the
partition's output gradient to its input gradient), and ``copy``.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generator, List, Optional

import torch

from .checkpoint import is_recomputing

__all__ = ["Span", "Recorder", "span", "compute_span", "active"]


@dataclass
class Span:
    kind: str          # forward | recompute | backward | copy
    partition: int
    microbatch: int
    device: str
    start: float       # seconds, time.perf_counter()
    end: float
    thread: str = ""


@dataclass
class Recorder:
    """Collects spans while active: ``with Recorder() as rec: ...``."""

    spans: List[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def __enter__(self) -> "Recorder":
        global _active
        self._previous = _active
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = self._previous


_active: Optional[Recorder] = None


def active() -> Optional[Recorder]:
    return _active


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def span(kind: str, partition: int, microbatch: int, device: torch.device) -> Generator[None, None, None]:
    recorder = _active
    if recorder is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync(device)
        recorder.add(Span(kind, partition, microbatch, str(device), start, time.perf_counter(),
                          threading.current_thread().name))


@contextmanager
def compute_span(partition: int, microbatch: int, device: torch.device) -> Generator[None, None, None]:
    """A forward or recompute span, and the backward markers around the computation."""
    if _active is None:
        yield
        return
    with span("recompute" if is_recomputing() else "forward", partition, microbatch, device):
        yield
