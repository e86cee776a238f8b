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
from typing import TYPE_CHECKING, Generator, List, Optional

import torch

from ._checkpoint import is_recomputing
from ._phony import get_phony
from ._stream import synchronize

if TYPE_CHECKING:
    from ._microbatch import Batch

__all__ = ["Span", "Recorder", "span", "compute_span", "active", "mark_backward", "close_backward"]


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
        synchronize(device)
        recorder.add(Span(kind, partition, microbatch, str(device), start, time.perf_counter(),
                          threading.current_thread().name))


@contextmanager
def compute_span(partition: int, microbatch: int, device: torch.device) -> Generator[None, None, None]:
    """A forward span, or a recompute span when the partition runs again for backward."""
    if _active is None:
        yield
        return
    with span("recompute" if is_recomputing() else "forward", partition, microbatch, device):
        yield


class _BackwardEnter(torch.autograd.Function):
    """Identity; its backward marks the moment a partition's output gradient arrives."""

    @staticmethod
    def forward(ctx, marks: dict, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.marks = marks
        ctx.set_materialize_grads(False)  # an absent gradient stays None (fxpipe.runtime._dependency)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):  # type: ignore[override]
        ctx.marks.setdefault("start", time.perf_counter())
        return None, grad


class _BackwardExit(torch.autograd.Function):
    """Identity; its backward closes the backward span at the partition's input."""

    @staticmethod
    def forward(ctx, marks: dict, recorder: Recorder, key: tuple, x: torch.Tensor, phony: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.marks, ctx.recorder, ctx.key = marks, recorder, key
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):  # type: ignore[override]
        partition, microbatch, device = ctx.key
        synchronize(torch.device(device))
        end = time.perf_counter()
        start = ctx.marks.get("start", end)
        ctx.recorder.add(Span("backward", partition, microbatch, device, start, end, threading.current_thread().name))
        return None, None, None, grad, None


def mark_backward(batch_in: "Batch", partition: int, microbatch: int, device: torch.device) -> Optional[dict]:
    """Marks a task's input for a backward span; returns the marks to close on its output."""
    recorder = _active
    if recorder is None or not torch.is_grad_enabled():
        return None
    anchor = batch_in.anchor()
    marks: dict = {}
    if anchor is not None:
        # The phony makes the span close even where the input itself needs no grad.
        phony = get_phony(batch_in[anchor].device, requires_grad=True)
        batch_in[anchor] = _BackwardExit.apply(marks, recorder, (partition, microbatch, str(device)), batch_in[anchor], phony)
    return marks


def close_backward(batch_out: "Batch", marks: Optional[dict]) -> None:
    if marks is None:
        return
    anchor = batch_out.anchor()
    if anchor is not None and batch_out[anchor].requires_grad:
        batch_out[anchor] = _BackwardEnter.apply(marks, batch_out[anchor])
