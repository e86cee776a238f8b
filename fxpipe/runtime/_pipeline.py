"""The pipeline schedule: clock cycles over (micro-batch, partition) tasks.

At clock tick k every task (i, j) with i + j = k runs: micro-batch i on partition j. Before
computing, the *fence* adds the dependencies and copies for the tick (copies are issued
before computes, so they overlap); then every task is handed to its device's worker and
the caller waits for the tick to finish. The first failure is re-raised with its original
type and traceback once every task of the tick has returned, and no later tick starts.

Worker threads and copy streams are runtime state: ``close()`` ends them for good, and
copies and pickles of a pipeline leave them out (the copy makes its own on first use).
"""

from __future__ import annotations

import queue
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import MicroBatchError, PipelineClosedError
from ._checkpoint import Checkpointing
from ._copy import copy, wait
from ._dependency import depend_tensors
from ._forward_modes import ForwardModes, StageLayout
from ._microbatch import Batch
from ._randomness import may_draw_random, stage_generators
from ._skip_layout import SkipLayout
from ._skip_tracker import SkipTrackerThroughPortals, merge_phony
from ._stage_portals import StagePortals
from ._stream import AbstractStream, current_stream, new_stream, use_device
from ._worker import Task, WorkerPool
from . import _timeline as timeline

__all__ = ["PipelineRunner", "PipelineClosedError", "clock_cycles", "depend"]

Schedule = List[Tuple[int, int]]
#: one micro-batch's skips: torchgpipe's tracker for @skippable layers, or generated code's portals
Tracker = Union[SkipTrackerThroughPortals, StagePortals]


def clock_cycles(m: int, n: int) -> Iterable[Schedule]:
    """Yields, per clock tick, the (micro-batch, partition) pairs that run in it.

    For m=3 micro-batches and n=3 partitions::

        k=0: (0,0)
        k=1: (1,0) (0,1)
        k=2: (2,0) (1,1) (0,2)
        k=3:       (2,1) (1,2)
        k=4:             (2,2)
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def depend(fork_from: Batch, join_to: Batch) -> None:
    """Makes backward of ``fork_from`` wait for backward of ``join_to`` (reverse order).

    Only between tensors that both require grad: the Fork/Join node would make a tensor that
    needs none (stage 0's input, a value made from buffers) need one, and the stage would
    compute its gradient for nothing. Without a gradient path on one side there is no
    backward to order there; autograd runs the latest-created node first anyway."""
    a, b = fork_from.anchor(), join_to.anchor()
    if a is None or b is None or not (fork_from[a].requires_grad and join_to[b].requires_grad):
        return
    fork_from[a], join_to[b] = depend_tensors(fork_from[a], join_to[b])


class PipelineRunner:
    """Runs micro-batches through partitions placed on devices (the engine behind both front
    ends, ``fxpipe.GPipe`` and ``fxpipe.pipeline``).

    ``spread`` says how a partition is called: ``False`` passes one argument (a tensor or a
    tuple of tensors, as ``nn.Sequential`` layers expect), ``True`` passes each value as a
    positional argument (generated stage code). ``skip_layout`` routes the skips:
    ``@skippable`` layers' (``stage_portals=False``) or the portals of generated stage code
    (``stage_portals=True``). Worker threads (one per device) and copy streams are created
    once and reused by every call; with only CPU devices the tasks run on the caller's
    thread unless ``threads=True``.

    Three switches exist for the ablation in ``benchmarks/throughput.py`` (not public API; the
    defaults are the paper's runtime, and every setting computes the same values):

    - ``copy_streams_on``: ``False`` issues copies on each device's compute stream instead of
      a copy stream per (partition, micro-batch), so they no longer overlap computation.
    - ``recompute_ahead``: ``False`` recomputes a checkpointed task where backward first
      unpacks one of its saved tensors, i.e. after the incoming gradient (copy) arrived,
      instead of from a Recompute node forked off the output, which backward reaches before
      the Wait for that copy (paper, section 3.2.1). ``None`` (default): ahead for a
      partition on an accelerator whose gradients come from another device (a later
      partition lives elsewhere), since only then is there a copy to overlap; lazily
      otherwise: on CPU nothing is asynchronous, and stages sharing one GPU have no copy
      between them (measured on an H100, U-Net 4 stages x 8 micro-batches: ahead gained
      0.5 % in step time and cost 31 % more peak memory, up to 2.8x the activation floor
      with ``'always'``: every stage's recomputation ran as soon as it could, all at once on
      the one device's autograd thread); ``True``: ahead everywhere (what tests use to run
      that path on CPU); ``False``: never.
    - ``order_backward``: ``False`` drops the Fork/Join edges that make micro-batch i-1's
      backward on a partition wait for micro-batch i's; autograd then orders by data alone.
      ``None`` (default): the edges unless the tasks run inline on the caller's thread (CPU
      only), where autograd already runs the latest-created node first -- the reverse clock
      order -- and each edge would only cost a Python autograd Function; ``True``: always.
    """

    copy_streams_on: bool = True
    recompute_ahead: Optional[bool] = None
    order_backward: Optional[bool] = None

    def __init__(
        self,
        partitions: Sequence[Callable[..., Any]],
        devices: Sequence[torch.device],
        *,
        skip_layout: Optional[SkipLayout] = None,
        stage_portals: bool = False,
        spread: bool = False,
        threads: Optional[bool] = None,
    ) -> None:
        if len(partitions) != len(devices):
            raise ValueError(f"{len(partitions)} partitions but {len(devices)} devices")
        self.devices = list(devices)
        self.set_partitions(partitions, skip_layout)
        self._tracker = StagePortals if stage_portals else SkipTrackerThroughPortals
        self.spread = spread
        # None: worker threads when a partition is on an accelerator; inline on CPU.
        self.threads = threads
        self._pool: Optional[WorkerPool] = None
        self._copy_streams: List[List[AbstractStream]] = [[] for _ in self.devices]
        self.closed = False
        #: how errors name the pipeline; front ends set their own class name
        self.label = "this pipeline"

    def set_partitions(self, partitions: Sequence[Callable[..., Any]], skip_layout: Optional[SkipLayout] = None) -> None:
        """Runs ``partitions`` from now on, one per device as before (a front end may hold
        several cuts of one model and switch between them); the worker threads and copy
        streams stay."""
        if len(partitions) != len(self.devices):
            raise ValueError(f"{len(partitions)} partitions but {len(self.devices)} devices")
        self.partitions = list(partitions)
        # Buffers each partition updates in forward (generated stages declare them), read
        # once here rather than per task: the recomputation runs on their snapshot.
        self._states = [getattr(p, "mutable_state", ()) for p in self.partitions]
        # Whether each may draw random numbers: only those get their RNG states saved for
        # the recomputation of a checkpointed task (also decided once, from the graph).
        self._random = [may_draw_random(p) for p in self.partitions]
        # torch.Generator objects of their own they draw from (saved and restored alike).
        self._generators = [stage_generators(p) for p in self.partitions]
        # Their modules and parameters, whose flags and versions each forward records.
        self._layouts = [StageLayout(p, [m.__dict__[w][k] for m, w, k in s if w == "_parameters"])
                         for p, s in zip(self.partitions, self._states)]
        self.skip_layout = skip_layout if skip_layout is not None else SkipLayout(len(self.partitions), {})

    def close(self, wait: bool = True) -> None:
        """Stops the worker threads (``wait``: until they have ended) and refuses later runs.

        Idempotent. Copy streams are dropped; the partitions are left as they are.
        """
        self.closed = True
        pool, self._pool = self._pool, None
        self._copy_streams = [[] for _ in self.devices]
        if pool is not None:
            pool.close(wait=wait)

    def __getstate__(self) -> dict:
        # Threads, queues, finalizers and CUDA streams neither copy nor pickle; a copy
        # creates its own on first use.
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_copy_streams"] = [[] for _ in self.devices]
        return state

    def check_open(self) -> None:
        if self.closed:
            raise PipelineClosedError(
                f"{self.label} was closed (by close() or at the end of its `with` block): its "
                "worker threads are stopped and its deferred BatchNorm layers are plain BatchNorm "
                "again. Build a new pipeline to run the model, or use the model itself."
            )

    @property
    def workers(self) -> WorkerPool:
        self.check_open()
        if self._pool is None:
            self._pool = WorkerPool(self.devices, threads=self.threads)
        return self._pool

    def copy_streams(self, m: int) -> List[List[AbstractStream]]:
        """One copy stream per (partition, micro-batch), created on first need (with
        ``copy_streams_on`` off: the device's compute stream, m times)."""
        if not self.copy_streams_on:
            return [[current_stream(d)] * m for d in self.devices]
        for streams, device in zip(self._copy_streams, self.devices):
            while len(streams) < m:
                streams.append(new_stream(device))
        return self._copy_streams

    def run(self, batches: List[Batch], checkpoint_stop: int,
            on_output: Optional[Callable[[int, Batch], Batch]] = None) -> None:
        """Runs every micro-batch through every partition; ``batches`` become the outputs.

        Micro-batches ``i < checkpoint_stop`` are checkpointed.

        ``on_output`` gives the 1F1B order (:mod:`fxpipe.runtime._orders`): right after the
        tick in which micro-batch ``i`` leaves the last partition, ``on_output(i, output)``
        runs (its loss and backward) and what it returns replaces the output in ``batches``.
        No Fork/Join then links micro-batches: each one's graph is its own, backwarded alone.
        """
        self.check_open()
        m = len(batches)
        n = len(self.partitions)
        skip_trackers: List[Tracker] = [self._tracker(self.skip_layout) for _ in range(m)]
        copy_streams = self.copy_streams(m)
        results: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        ahead = self._recompute_ahead()
        order = not self.workers.inline if self.order_backward is None else self.order_backward
        order = order and on_output is None
        # Once per stage per forward: the modes and weights its recomputations must match.
        modes = [ForwardModes(layout) for layout in self._layouts] if checkpoint_stop > 0 else None
        # the micro-batches' sizes, read before their inputs are replaced by outputs: only a refusal names them
        sizes = [next((len(v) for v in b.values if isinstance(v, torch.Tensor) and v.dim()), None) for b in batches]
        try:
            for schedule in clock_cycles(m, n):
                self._fence(batches, schedule, skip_trackers, copy_streams, order)
                self._compute(batches, schedule, skip_trackers, copy_streams, checkpoint_stop, results, ahead, modes)
                if on_output is not None and schedule[-1][1] == n - 1:
                    i = schedule[-1][0]  # the micro-batch that left the last partition in this tick
                    batches[i] = on_output(i, batches[i])
        except ValueError as e:
            if "Expected more than 1 value per channel" in str(e):
                raise _one_sample_error(sizes) from e
            raise

    def _recompute_ahead(self) -> List[bool]:
        """Per partition: recompute ahead of its backward? (see ``recompute_ahead``)."""
        n = len(self.devices)
        if self.recompute_ahead is not None:
            return [self.recompute_ahead] * n
        return [self.devices[j].type != "cpu" and any(d != self.devices[j] for d in self.devices[j + 1:])
                for j in range(n)]

    def _fence(
        self, batches: List[Batch], schedule: Schedule,
        skip_trackers: List[Tracker], copy_streams: List[List[AbstractStream]], order: bool,
    ) -> None:
        """Adds this tick's backward-order dependencies and issues its copies."""
        for i, j in schedule:
            if i != 0 and order:
                # [1] Backward of micro-batch i-1 on partition j waits for micro-batch i's.
                depend(batches[i - 1], batches[i])
            next_stream = copy_streams[j][i]
            for prev_j, ns, name in self.skip_layout.copy_policy(j):
                prev_stream = copy_streams[prev_j][i]
                with timeline.span("copy", j, i, self.devices[j]):  # [1] PortalCopy
                    skip_trackers[i].copy(batches[i], prev_stream, next_stream, ns, name)
            if j != 0:
                with timeline.span("copy", j, i, self.devices[j]):  # [1] Copy
                    copy(batches[i], copy_streams[j - 1][i], next_stream)

    # One task (i, j), micro-batch i on partition j, as autograd sees it. Forward runs down;
    # backward runs up, in the order the phony edges of Fork/Join impose:
    #
    #   output of task (i, j-1)                           input of task (i-1, j)
    #        |                                                      .
    #   [1] Copy: copy stream of j-1 -> copy stream of j            .  [1] depend(): Fork/Join, so
    #        |    and PortalCopy of each portal ending at j,        .      the backward of (i-1, j)
    #        |    forked off this input and joined back  . . . . . .      waits for (i, j)'s
    #   [2] Wait: copy stream -> compute stream
    #        |
    #   [3] the partition, or Checkpoint (keeps no activations); stash/pop in it add
    #        |    PortalBlue/PortalOrange, whose phonies ride on the batch (its carry)
    #   [4] Wait: compute stream -> copy stream, for the Copy of task (i, j+1)
    #        |
    #   [5] Recompute, forked off the output and joined back: in backward the recomputation
    #        |    starts as soon as the output's gradient is being made, overlapping the
    #        v    gradient copy from partition j+1 (paper, section 3.2.1)
    #   input of task (i, j+1)
    #
    # [1] is _fence; [2] and [3] run per task below; [4] and [5] once the whole tick ran.
    # [5] only when recomputing ahead (recompute_ahead: where a later partition is on another
    # accelerator; elsewhere a checkpointed task recomputes where its first saved tensor is unpacked), depend() only when ordering (order_backward).
    def _compute(
        self, batches: List[Batch], schedule: Schedule,
        skip_trackers: List[Tracker], copy_streams: List[List[AbstractStream]],
        checkpoint_stop: int, results: "queue.SimpleQueue[Any]", ahead: List[bool],
        modes: Optional[List[ForwardModes]],
    ) -> None:
        n = len(self.partitions)
        streams = [current_stream(d) for d in self.devices]
        workers = self.workers
        marks = {}
        for i, j in schedule:
            batch = batches[i]
            if j != 0:
                wait(batch, copy_streams[j][i], streams[j])  # [2]
            marks[i] = timeline.mark_backward(batch, j, i, self.devices[j])
            function = _partition_function(self.partitions[j], skip_trackers[i], self.spread, i, j, self.devices[j])
            if i < checkpoint_stop:
                chk = Checkpointing(function, batch, self.devices[j], random=self._random[j],
                                    state=self._states[j], ahead=ahead[j], where=f"partition {j}",
                                    modes=modes[j] if modes is not None else None, generators=self._generators[j])
                task = Task(streams[j], compute=chk.checkpoint, finalize=chk.recompute if ahead[j] else None,
                            result_queue=results, key=(i, j))
                del chk
            else:
                task = Task(streams[j], compute=_bind(function, batch), finalize=None, result_queue=results, key=(i, j))
            workers.submit(j, task)  # [3], on the device's worker
            del task, function

        outcomes = {}
        for _ in schedule:
            ok, key, payload = results.get()
            outcomes[key] = (ok, payload)
        for i, j in schedule:
            ok, payload = outcomes[(i, j)]
            if not ok:
                _, exc, tb = payload
                raise exc.with_traceback(tb)
        for i, j in schedule:
            task, batch = outcomes[(i, j)][1]
            if j != n - 1:
                wait(batch, streams[j], copy_streams[j][i])  # [4]
            with use_device(self.devices[j]):
                task.finalize(batch)  # [5]
            timeline.close_backward(batch, marks[i])
            batches[i] = batch


def _bind(function: Callable[[Batch], Batch], batch: Batch) -> Callable[[], Batch]:
    return lambda: function(batch)


def _partition_function(
    partition: Callable[..., Any], skip_tracker: Tracker, spread: bool,
    i: int, j: int, device: torch.device,
) -> Callable[[Batch], Batch]:
    """The computation of task (i, j), also replayed as is by the recomputation."""

    def function(batch: Batch) -> Batch:
        # Plain attribute swaps, not context managers: this runs once per task (and per
        # recomputation), where every microsecond of Python shows in the overhead.
        previous = skip_tracker.activate(batch)
        output: Optional[Batch] = None
        try:
            if timeline.active() is None:
                output = batch.call(partition, spread=spread)
            else:
                with timeline.compute_span(j, i, device):
                    output = batch.call(partition, spread=spread)
        finally:
            skip_tracker.deactivate(previous, output)
        # The carry passes on (generated stages' stashes were added to it above).
        output.carry = merge_phony(output.carry, batch.carry)
        return output

    return function


def _one_sample_error(sizes: Sequence[Optional[int]]) -> MicroBatchError:
    """A micro-batch of one sample through BatchNorm in training with no other dims to average
    over (a BatchNorm1d on features): torch refuses it where the whole batch normalises fine."""
    return MicroBatchError(
        f"BatchNorm in training mode cannot normalise a micro-batch of one sample over its features (torch: "
        f"'Expected more than 1 value per channel'), and this batch split into micro-batches of {sizes} samples; the "
        "model on the whole batch can. What to do: a batch size that chunks splits into micro-batches of 2 samples "
        "or more (drop_last=True, or a batch sampler keeping whole micro-batches), or fewer chunks for this batch.")

