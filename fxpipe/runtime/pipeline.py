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
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from ..errors import PipelineClosedError
from ..skip.layout import SkipLayout
from ..skip.tracker import SkipTrackerThroughPortals, merge_phony, swap_skip_tracker
from .checkpoint import Checkpointing
from .copy import copy, wait
from .dependency import depend_tensors
from .microbatch import Batch
from .stream import AbstractStream, current_stream, new_stream, use_device
from .worker import Task, WorkerPool
from . import timeline

__all__ = ["Pipeline", "PipelineClosedError", "clock_cycles", "depend"]

Schedule = List[Tuple[int, int]]


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
    """Makes backward of ``fork_from`` wait for backward of ``join_to`` (reverse order)."""
    a, b = fork_from.anchor(), join_to.anchor()
    if a is None or b is None:
        return
    fork_from[a], join_to[b] = depend_tensors(fork_from[a], join_to[b])


class Pipeline:
    """Runs micro-batches through partitions placed on devices.

    ``spread`` says how a partition is called: ``False`` passes one argument (a tensor or a
    tuple of tensors, as ``nn.Sequential`` layers expect), ``True`` passes each value as a
    positional argument (generated stage code). Worker threads (one per device) and copy
    streams are created once and reused by every call; with only CPU devices the tasks run
    on the caller's thread unless ``threads=True``.
    """

    def __init__(
        self,
        partitions: Sequence[Callable[..., Any]],
        devices: Sequence[torch.device],
        *,
        skip_layout: Optional[SkipLayout] = None,
        spread: bool = False,
        threads: Optional[bool] = None,
    ) -> None:
        if len(partitions) != len(devices):
            raise ValueError(f"{len(partitions)} partitions but {len(devices)} devices")
        self.partitions = list(partitions)
        # Buffers each partition updates in forward (generated stages declare them), read
        # once here rather than per task: the recomputation runs on their snapshot.
        self._states = [getattr(p, "mutable_state", ()) for p in self.partitions]
        self.devices = list(devices)
        self.skip_layout = skip_layout if skip_layout is not None else SkipLayout(len(partitions), {})
        self.spread = spread
        # None: worker threads when a partition is on an accelerator; inline on CPU.
        self.threads = threads
        self._pool: Optional[WorkerPool] = None
        # Nothing to overlap recomputation with when no copy is asynchronous.
        self._cpu_only = all(d.type == "cpu" for d in self.devices)
        self._copy_streams: List[List[AbstractStream]] = [[] for _ in self.devices]
        self.closed = False
        #: how errors name the pipeline; front ends set their own class name
        self.label = "this pipeline"

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
        """One copy stream per (partition, micro-batch), created on first need."""
        for streams, device in zip(self._copy_streams, self.devices):
            while len(streams) < m:
                streams.append(new_stream(device))
        return self._copy_streams

    def run(self, batches: List[Batch], checkpoint_stop: int) -> None:
        """Runs every micro-batch through every partition; ``batches`` become the outputs.

        Micro-batches ``i < checkpoint_stop`` are checkpointed.
        """
        self.check_open()
        m = len(batches)
        skip_trackers = [SkipTrackerThroughPortals(self.skip_layout) for _ in range(m)]
        copy_streams = self.copy_streams(m)
        results: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        for schedule in clock_cycles(m, len(self.partitions)):
            self._fence(batches, schedule, skip_trackers, copy_streams)
            self._compute(batches, schedule, skip_trackers, copy_streams, checkpoint_stop, results)

    def _fence(
        self, batches: List[Batch], schedule: Schedule,
        skip_trackers: List[SkipTrackerThroughPortals], copy_streams: List[List[AbstractStream]],
    ) -> None:
        """Adds this tick's backward-order dependencies and issues its copies."""
        for i, j in schedule:
            if i != 0:
                # Backward of micro-batch i-1 on partition j waits for micro-batch i's.
                depend(batches[i - 1], batches[i])
            next_stream = copy_streams[j][i]
            for prev_j, ns, name in self.skip_layout.copy_policy(j):
                prev_stream = copy_streams[prev_j][i]
                with timeline.span("copy", j, i, self.devices[j]):
                    skip_trackers[i].copy(batches[i], prev_stream, next_stream, ns, name)
            if j != 0:
                with timeline.span("copy", j, i, self.devices[j]):
                    copy(batches[i], copy_streams[j - 1][i], next_stream)

    def _compute(
        self, batches: List[Batch], schedule: Schedule,
        skip_trackers: List[SkipTrackerThroughPortals], copy_streams: List[List[AbstractStream]],
        checkpoint_stop: int, results: "queue.SimpleQueue[Any]",
    ) -> None:
        n = len(self.partitions)
        streams = [current_stream(d) for d in self.devices]
        workers = self.workers
        marks = {}
        for i, j in schedule:
            batch = batches[i]
            if j != 0:
                wait(batch, copy_streams[j][i], streams[j])
            marks[i] = timeline.mark_backward(batch, j, i, self.devices[j])
            function = _partition_function(self.partitions[j], skip_trackers[i], self.spread, i, j, self.devices[j])
            if i < checkpoint_stop:
                chk = Checkpointing(function, batch, self.devices[j], fused=self._cpu_only,
                                    state=self._states[j],
                                    anchor_carries=not self.spread)
                task = Task(streams[j], compute=chk.checkpoint, finalize=chk.recompute, result_queue=results, key=(i, j))
                del chk
            else:
                task = Task(streams[j], compute=_bind(function, batch), finalize=None, result_queue=results, key=(i, j))
            workers.submit(j, task)
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
                wait(batch, streams[j], copy_streams[j][i])
            with use_device(self.devices[j]):
                task.finalize(batch)
            timeline.close_backward(batch, marks[i])
            batches[i] = batch


def _bind(function: Callable[[Batch], Batch], batch: Batch) -> Callable[[], Batch]:
    return lambda: function(batch)


def _partition_function(
    partition: Callable[..., Any], skip_tracker: SkipTrackerThroughPortals, spread: bool,
    i: int, j: int, device: torch.device,
) -> Callable[[Batch], Batch]:
    """The computation of task (i, j), also replayed as is by the recomputation."""

    def function(batch: Batch) -> Batch:
        # Plain attribute swaps, not context managers: this runs once per task (and per
        # recomputation), where every microsecond of Python shows in the overhead.
        previous = swap_skip_tracker(skip_tracker)
        skip_tracker.input_batch = batch
        try:
            if timeline.active() is None:
                output = batch.call(partition, spread=spread)
            else:
                with timeline.compute_span(j, i, device):
                    output = batch.call(partition, spread=spread)
        finally:
            skip_tracker.input_batch = None
            swap_skip_tracker(previous)
        # The carry passes on, with this stage's stashes added.
        output.carry = merge_phony(output.carry, batch.carry)
        skip_tracker.join_pending(output)
        return output

    return function
