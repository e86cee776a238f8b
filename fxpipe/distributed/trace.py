"""What each rank of a distributed pipeline did, and when: spans on one clock, and the bubble.

::

    from fxpipe.distributed.trace import record, bubble_fractions
    with record(pipe) as trace:                  # every rank, around the steps to trace
        for _ in range(3):
            pipe.step(x, target=y)
    trace.spans                                  # every rank's spans, on every rank
    bubble_fractions(trace.spans)                # [idle share of rank 0's steps, rank 1's, ...]

While recording, this rank's torch ``PipelineStage`` objects have their methods wrapped on
the instance (undone on exit, so nothing changes for later steps):

* ``forward_one_chunk`` -> a ``forward`` span, ``backward_one_chunk`` -> ``backward`` (with a
  checkpointed micro-batch's recomputation inside it), ``backward_weight_one_chunk`` ->
  ``weight`` (zero-bubble schedules), and the schedule's loss on the last stage -> ``loss``;
* ``recv``: the time this rank's thread is blocked in ``Work.wait()`` of a receive, i.e.
  waiting for the activation (``phase='forward'``) or gradient (``'backward'``) of a
  micro-batch; ``send``: the time blocked waiting for a send to complete. The transfers
  themselves run in gloo's threads and may overlap computation; only the blocking is
  measured. The schedules issue and wait for transfers through torch's
  ``schedules._batch_p2p`` / ``_wait_batch_p2p``, which are replaced while recording: the
  ``get_*_ops`` wrappers label each operation, the replacements time each wait by label.
* ``step``: one ``pipe.step`` call on this rank.

Spans are recorded only inside ``pipe.step``. Clocks: each rank reads ``time.perf_counter``;
on entry rank 0 measures every rank's offset to its own clock with a few ping-pongs (the
round trip with the smallest delay wins; the error is at most half of it, microseconds on
one host), and on exit every rank's spans are shifted onto rank 0's clock and gathered to
every rank (``all_gather_object``): the trace is the same everywhere.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules

from fxpipe.errors import DistributedError

from ._pipe import DistributedPipeline

__all__ = ["Span", "Trace", "record", "bubble_fractions", "COMPUTE_KINDS", "SPAN_KINDS"]

#: kinds during which a rank computes; the rest of a step is its bubble
COMPUTE_KINDS = ("forward", "backward", "weight", "loss")
SPAN_KINDS = ("step", *COMPUTE_KINDS, "recv", "send")

_CLOCK_ROUNDS = 8


@dataclass(frozen=True)
class Span:
    """One interval on one rank; times in seconds on rank 0's ``perf_counter`` clock.

    ``stage`` and ``microbatch`` are -1 for a ``step`` span (and for a transfer whose
    operation was not labelled); ``phase`` is ``'forward'`` / ``'backward'`` for a transfer
    (what it carries: an activation or a gradient), else ``''``; ``step`` is the index of the
    ``pipe.step`` call within the recording.
    """

    kind: str
    rank: int
    stage: int
    microbatch: int
    step: int
    start: float
    end: float
    phase: str = ""


@dataclass
class Trace:
    """What :func:`record` yields; ``spans`` is filled on exit (every rank's, on every rank)."""

    spans: list[Span] = field(default_factory=list)
    world_size: int = 0
    #: stage indices per rank
    stages: list[list[int]] = field(default_factory=list)


def bubble_fractions(spans: Sequence[Span]) -> list[float]:
    """Per rank (index = rank), the share of its ``pipe.step`` time spent not computing.

    For each rank: the total length of its ``step`` spans, minus the part of it covered by
    its compute spans (:data:`COMPUTE_KINDS`, merged where they overlap), over that total.
    The idle part is the pipeline bubble as the paper draws it -- waiting for an activation
    or a gradient -- plus what a step does around the schedule (waiting on sends, the loss
    broadcast, tied-gradient all-reduces). Raises ``ValueError`` for a rank with no step.
    """
    world = 1 + max((s.rank for s in spans), default=-1)
    fractions = []
    for r in range(world):
        steps = [s for s in spans if s.rank == r and s.kind == "step"]
        total = sum(s.end - s.start for s in steps)
        if not steps or total <= 0:
            raise ValueError(f"rank {r} has no recorded pipe.step in these spans: record(pipe) around step() calls")
        busy = 0.0
        for st in steps:
            inside = sorted((max(s.start, st.start), min(s.end, st.end)) for s in spans
                            if s.rank == r and s.kind in COMPUTE_KINDS and s.end > st.start and s.start < st.end)
            busy += _union_length(inside)
        fractions.append(max(0.0, (total - busy) / total))
    return fractions


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by sorted ``(start, end)`` intervals."""
    length, cur_start, cur_end = 0.0, None, None
    for a, b in intervals:
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                length += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        length += cur_end - cur_start  # type: ignore[operator]
    return length


# -- clocks ----------------------------------------------------------------------------------
def clock_offsets(group: dist.ProcessGroup, rounds: int = _CLOCK_ROUNDS) -> list[float]:
    """Per rank of ``group``, its ``perf_counter`` minus rank 0's, on every rank (collective).

    Rank 0 pings each rank ``rounds`` times: it sends its time ``t0``, the rank answers with
    its own time ``t``, rank 0 reads ``t1`` on arrival; the offset is ``t - (t0 + t1) / 2`` from
    the round with the shortest round trip.
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    box = torch.zeros(1, dtype=torch.float64)
    offsets = [0.0] * world
    for r in range(1, world):
        peer = dist.get_global_rank(group, r)
        zero = dist.get_global_rank(group, 0)
        best = (float("inf"), 0.0)
        for _ in range(rounds):
            if me == 0:
                t0 = time.perf_counter()
                dist.send(torch.tensor([t0], dtype=torch.float64), dst=peer, group=group)
                dist.recv(box, src=peer, group=group)
                t1 = time.perf_counter()
                best = min(best, (t1 - t0, box.item() - (t0 + t1) / 2))
            elif me == r:
                dist.recv(box, src=zero, group=group)
                dist.send(torch.tensor([time.perf_counter()], dtype=torch.float64), dst=zero, group=group)
        offsets[r] = best[1]
    shared: list[Any] = [offsets]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    return list(shared[0])


# -- recording -------------------------------------------------------------------------------
def _torch_stages(schedule: Any) -> list[Any]:
    """The ``PipelineStage`` objects a torch schedule drives (one, or several per rank)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if any(s is None or not hasattr(s, "forward_one_chunk") for s in stages):
        raise DistributedError(f"cannot find the PipelineStage objects of the torch schedule {type(schedule).__name__} "
                               f"(torch {torch.__version__}): this torch version is not supported by fxpipe's tracing")
    return list(stages)


class _Recorder:
    """Wraps a pipeline's stages and torch's p2p helpers; collects this rank's spans."""

    _active: Optional["_Recorder"] = None

    def __init__(self, pipe: DistributedPipeline) -> None:
        self.pipe = pipe
        self.rank = pipe.rank
        self.stages = _torch_stages(pipe.schedule)
        self.spans: list[tuple] = []
        self.step = -1
        self.in_step = False
        self.busy = False  # inside a compute span: nested calls are part of it
        self.op_labels: dict[int, tuple[Any, tuple[str, int, int, str]]] = {}   # id(P2POp) -> (op, label)
        self.work_labels: dict[int, tuple[Any, tuple[str, int, int, str]]] = {}  # id(Work) -> (work, label)
        self._undo: list[Callable[[], None]] = []

    # instance-level wrapping, undone in reverse order
    def _wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        saved = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, make(getattr(obj, name)))

        def undo() -> None:
            if saved is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, saved)
        self._undo.append(undo)

    def _add(self, kind: str, stage: int, mb: int, start: float, end: float, phase: str = "") -> None:
        self.spans.append((kind, self.rank, stage, mb, self.step, start, end, phase))

    def _compute(self, kind: str, stage: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if not self.in_step or self.busy:
                    return original(*args, **kwargs)
                chunk = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                self.busy = True
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.busy = False
                    self._add(kind, stage, int(chunk), start, time.perf_counter())
            return wrapper
        return make

    def _ops(self, kind: str, stage: int, phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(chunk: int) -> Any:
                ops = original(chunk)
                if self.in_step:
                    for op in ops:
                        self.op_labels[id(op)] = (op, (kind, stage, int(chunk), phase))
                return ops
            return wrapper
        return make

    def _loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any, **kwargs: Any) -> Any:
            if not self.in_step or not stage.is_last:
                return original(stage, output, target_mbs, mb_index, *args, **kwargs)
            start = time.perf_counter()
            try:
                return original(stage, output, target_mbs, mb_index, *args, **kwargs)
            finally:
                self._add("loss", stage.stage_index, int(mb_index), start, time.perf_counter())
        return wrapper

    def _batch_p2p(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(p2p_ops: list, *args: Any, **kwargs: Any) -> Any:
            works = original(p2p_ops, *args, **kwargs)
            if self.in_step:
                labels = [self.op_labels.pop(id(op), (None, None))[1] for op in p2p_ops]
                if len(works) == len(p2p_ops):  # gloo: one work per operation, in order
                    pairs = zip(works, labels)
                else:  # coalesced: one work for several operations
                    pairs = ((w, ("recv" if any(lb and lb[0] == "recv" for lb in labels) else "send", -1, -1, ""))
                             for w in works)
                for w, label in pairs:
                    if label is not None:
                        self.work_labels[id(w)] = (w, label)
            return works
        return wrapper

    def _wait_batch_p2p(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(works: list, *args: Any, **kwargs: Any) -> Any:
            if not self.in_step:
                return original(works, *args, **kwargs)
            # torch's helper waits for each in turn: so do we, timing each; back-to-back
            # waits with one label (the tensors of one micro-batch) make one span
            last: Optional[tuple[str, int, int, str]] = None
            for w in works:
                start = time.perf_counter()
                original([w], *args, **kwargs)
                entry = self.work_labels.pop(id(w), None)
                if entry is None:
                    last = None
                    continue
                kind, stage, mb, phase = label = entry[1]
                if label == last:
                    start = self.spans.pop()[5]
                self._add(kind, stage, mb, start, time.perf_counter(), phase)
                last = label
        return wrapper

    def _step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.step += 1
            self.in_step = True
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.in_step = False
                self.op_labels.clear()
                self.work_labels.clear()
                self._add("step", -1, -1, start, time.perf_counter())
        return wrapper

    def __enter__(self) -> "_Recorder":
        if _Recorder._active is not None:
            raise DistributedError("fxpipe.distributed.trace.record is already recording in this process; "
                                   "nest no recordings (one pipeline at a time)")
        _Recorder._active = self
        for st in self.stages:
            k = st.stage_index
            self._wrap(st, "forward_one_chunk", self._compute("forward", k))
            self._wrap(st, "backward_one_chunk", self._compute("backward", k))
            self._wrap(st, "backward_weight_one_chunk", self._compute("weight", k))
            self._wrap(st, "get_fwd_recv_ops", self._ops("recv", k, "forward"))
            self._wrap(st, "get_bwd_recv_ops", self._ops("recv", k, "backward"))
            self._wrap(st, "get_fwd_send_ops", self._ops("send", k, "forward"))
            self._wrap(st, "get_bwd_send_ops", self._ops("send", k, "backward"))
        self._wrap(self.pipe.schedule, "_maybe_compute_loss", self._loss)
        self._wrap(_schedules, "_batch_p2p", self._batch_p2p)
        self._wrap(_schedules, "_wait_batch_p2p", self._wait_batch_p2p)
        self._wrap(self.pipe, "step", self._step)
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()
        _Recorder._active = None


class _Missing:
    pass


_MISSING = _Missing()


@contextmanager
def record(pipe: DistributedPipeline) -> Iterator[Trace]:
    """Records every rank's spans while the ``with`` block runs ``pipe.step`` calls.

    A collective: every rank of the pipeline enters and leaves it together (like ``step``).
    On a clean exit ``trace.spans`` holds every rank's spans, on rank 0's clock, on every
    rank; on an exception nothing is exchanged (the peers may be gone) and it propagates.
    """
    if not isinstance(pipe, DistributedPipeline):
        raise TypeError(f"record() takes the DistributedPipeline of fxpipe.distributed.pipeline, "
                        f"got {type(pipe).__name__}")
    group = pipe.group
    trace = Trace(world_size=pipe.world_size)
    pipe.agree_on_call("trace.record()", "start recording")  # entered on some ranks only: refused on every rank
    offsets = clock_offsets(group)
    recorder = _Recorder(pipe)
    with recorder:
        yield trace
    mine = (pipe.local, [(*s[:5], s[5] - offsets[pipe.rank], s[6] - offsets[pipe.rank], s[7])
                         for s in recorder.spans])
    every: list[Any] = [None] * pipe.world_size
    dist.all_gather_object(every, mine, group=group)
    trace.stages = [list(local) for local, _ in every]
    trace.spans = sorted((Span(*s) for _, spans in every for s in spans), key=lambda s: (s.start, s.rank))
