"""Persistent worker threads, one per device.

torchgpipe starts fresh threads on every forward, a fixed cost of several milliseconds per
call. Here a pipeline owns one long-lived daemon thread per distinct device. Threads never
hold a reference to the pipeline, only to their queues, so dropping the pipeline stops them
(a ``weakref.finalize`` sends the stop signal) and interpreter exit never waits on them.

Results go to a queue owned by the caller's run, not by the worker: if a run is abandoned
(an exception, a KeyboardInterrupt in the caller), late results land in that run's queue and
can never be mistaken for the next run's.
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref
from types import TracebackType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch

from ._autocast import autocast_state
from ._autocast import entered as entered_autocast
from ._microbatch import Batch
from ._stream import AbstractStream, is_cuda, use_device, use_stream

__all__ = ["Task", "WorkerPool", "ExcInfo"]

ExcInfo = Tuple[Type[BaseException], BaseException, TracebackType]


class Task:
    """One (micro-batch, partition) computation, run on a worker in the caller's grad mode
    and autocast state (both are thread-local, and a worker is another thread).

    ``compute`` runs on the device's worker thread; ``finalize`` (attaching the
    recomputation, for checkpointed tasks) runs on the caller's thread afterwards.
    """

    __slots__ = ("stream", "_compute", "_finalize", "_grad_enabled", "_autocast", "_num_threads", "result_queue",
                 "key")

    def __init__(
        self,
        stream: AbstractStream,
        *,
        compute: Callable[[], Batch],
        finalize: Optional[Callable[[Batch], None]],
        result_queue: "queue.SimpleQueue[Any]",
        key: Tuple[int, int],
    ) -> None:
        self.stream = stream
        self._compute = compute
        self._finalize = finalize
        self._grad_enabled = torch.is_grad_enabled()
        self._autocast = autocast_state()
        # torch.set_num_threads is per thread: workers follow the caller's setting.
        self._num_threads = torch.get_num_threads()
        self.result_queue = result_queue
        self.key = key

    def compute(self) -> Batch:
        if torch.get_num_threads() != self._num_threads:
            torch.set_num_threads(self._num_threads)
        if not is_cuda(self.stream) and torch.is_grad_enabled() == self._grad_enabled:
            with entered_autocast(self._autocast):  # a no-op on the caller's own thread
                return self._compute()
        with use_stream(self.stream), torch.set_grad_enabled(self._grad_enabled), entered_autocast(self._autocast):
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is None:
            return
        with use_stream(self.stream), torch.set_grad_enabled(self._grad_enabled), entered_autocast(self._autocast):
            self._finalize(batch)


def _worker(in_queue: "queue.SimpleQueue[Optional[Task]]", device: torch.device) -> None:
    with use_device(device):
        while True:
            task = in_queue.get()
            if task is None:
                return
            run_task(task)
            # Hold nothing between tasks: a kept output would keep its autograd graph alive.
            del task


def _stop(in_queues: List["queue.SimpleQueue[Optional[Task]]"]) -> None:
    for q in in_queues:
        q.put(None)


def run_task(task: Task) -> None:
    """Runs a task and reports its outcome to the task's result queue, never raising."""
    try:
        batch = task.compute()
    except BaseException:  # noqa: BLE001 - every failure must reach the caller, or it hangs
        exc_info = sys.exc_info()
        task.result_queue.put((False, task.key, exc_info))
        del exc_info
    else:
        task.result_queue.put((True, task.key, (task, batch)))
        del batch


class WorkerPool:
    """Worker threads for a list of devices; partitions on one device share its thread.

    With ``threads=False`` tasks run on the caller's thread instead. That is what a pool of
    CPU devices does by default: CPU "devices" share one thread anyway, so a worker would
    only add two thread hand-offs per task (30-40 us measured) without any overlap.
    """

    def __init__(self, devices: Sequence[torch.device], *, threads: Optional[bool] = None) -> None:
        if threads is None:
            threads = any(d.type != "cpu" for d in devices)
        self.inline = not threads
        by_device: Dict[torch.device, "queue.SimpleQueue[Optional[Task]]"] = {}
        self.threads: List[threading.Thread] = []
        for device in devices if threads else ():
            if device in by_device:
                continue
            q: "queue.SimpleQueue[Optional[Task]]" = queue.SimpleQueue()
            thread = threading.Thread(
                target=_worker, args=(q, device), name=f"fxpipe-worker-{device}", daemon=True
            )
            thread.start()
            by_device[device] = q
            self.threads.append(thread)
        self.in_queues = [by_device[d] for d in devices] if threads else []
        self._finalizer = weakref.finalize(self, _stop, list(by_device.values()))
        # At interpreter exit daemon threads are simply abandoned; waking them while the
        # interpreter tears down aborts the process ("terminate called ...").
        self._finalizer.atexit = False

    def submit(self, partition_index: int, task: Task) -> None:
        if self.inline:
            run_task(task)
            return
        self.in_queues[partition_index].put(task)

    def close(self, wait: bool = True) -> None:
        """Stops the threads now (they also stop when the pool is garbage-collected).

        With ``wait`` it returns once they have ended, so a closed pipeline leaves no thread
        behind; a worker closing its own pool (from inside a task) does not wait for itself.
        """
        self._finalizer()
        if not wait:
            return
        current = threading.current_thread()
        for thread in self.threads:
            if thread is not current:
                thread.join()
