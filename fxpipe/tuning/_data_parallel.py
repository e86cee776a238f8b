"""``dp x pp`` for ``N`` devices: replicas of a shorter pipeline, each on its share of the batch.

``fxpipe.distributed`` runs ``dp`` replicas of a ``pp``-rank pipeline on a ``('dp', 'pp')``
mesh with ``data_parallel='ddp'`` (:mod:`fxpipe.distributed._replicas`). A replica is an
ordinary pipeline of ``N / dp`` devices stepping on ``batch / dp`` samples, so its time and
memory are predicted by the same search (:class:`._search.Search`, on the first ``pp``
devices), and two things are added:

* **time**: after the schedule, each device's gradients are all-reduced over the replicas
  once, not overlapped with compute. A ring all-reduce sends ``2 (dp - 1) / dp`` times the
  bytes over the link, plus ``2 (dp - 1)`` latencies per 25 MiB bucket; the step ends when the
  slowest device is done. The link is ``link=``: between replicas on other hosts it is the
  network's, usually slower than the one between a host's devices.
* **memory**: each replica holds its stages whole (``'ddp'``), so parameters, gradients and
  optimizer state per device are a ``pp``-stage pipeline's; the all-reduce's flat bucket
  (at most 25 MiB) comes on top of them after the activations are gone. (``'fsdp'``, which
  divides the first three by ``dp`` and all-gathers each stage's parameters as it runs, is not
  proposed yet: its gathers and reduce-scatters per micro-batch are not modelled.)

Why replicas can win: a shorter pipeline has a smaller bubble at the same micro-batch count,
and each replica's micro-batches are ``dp`` times smaller; what they cost is the all-reduce
and whole copies of the stages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Sequence

from ..build import Checked
from ..distributed._replicas import BUCKET_BYTES
from ._result import Choice
from ._search import Search, Settings
from ._tensors import once_per_device
from ._units import format_bytes, format_seconds

__all__ = ["replica_counts", "replica_choices"]


def replica_counts(n_devices: int, batch: int, asked: Optional[Sequence[int]]) -> List[int]:
    """The replica counts ``dp > 1`` to consider: ``asked``, or every divisor of the devices
    leaving a pipeline of 2 ranks at least, whose share of the batch is whole."""
    if asked is not None:
        return sorted({int(d) for d in asked if d > 1})
    return [d for d in range(2, n_devices // 2 + 1) if n_devices % d == 0 and batch % d == 0]


def allreduce_seconds(nbytes: float, dp: int, link: float, latency: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``dp`` replicas, in buckets."""
    if nbytes <= 0 or dp < 2:
        return 0.0
    buckets = math.ceil(nbytes / BUCKET_BYTES)
    return 2 * (dp - 1) / dp * nbytes / link + 2 * (dp - 1) * latency * buckets


def replica_choices(model: Any, checked: Checked, settings: Settings, dp: int, progress: Any,
                    shared: Search) -> List[Choice]:
    """The distributed configurations of ``dp`` replicas of a ``N / dp``-device pipeline
    (``shared``: the search over all ``N`` devices, whose recordings per size are reused)."""
    pp = len(settings.devices) // dp
    batch = settings.batch // dp
    sub = dataclasses.replace(
        settings, devices=list(settings.devices[:pp]), batch=batch,
        schedules=[s for s in settings.schedules if s != "gpipe"],
        chunks=[c for c in settings.chunks if batch % c == 0] or [1],
        torch_devices=list(settings.torch_devices[:pp]) if settings.torch_devices is not None else None)
    search = Search(model, checked, sub, progress, shared=shared)
    choices = [c for c in search.run() if c.distributed]
    for c in choices:
        c.replicas = dp
        c.kwargs["data_parallel"] = "ddp"
        if not c.peak_bytes or c.plan is None:  # refused before it was predicted: nothing to add
            continue
        _, where = search.layout(c.schedule)
        _, trained = once_per_device(search.tensors(c.plan), where)
        grads: dict = {}
        for stage, device in enumerate(where):
            grads[str(device)] = grads.get(str(device), 0) + trained[stage]
        reduce_s = max(allreduce_seconds(b, dp, settings.link, settings.latency) for b in grads.values())
        c.step_s += reduce_s
        c.allreduce_s = reduce_s
        for device, nbytes in grads.items():
            after = c.static_bytes.get(device, 0.0) + min(BUCKET_BYTES, nbytes)
            c.peak_bytes[device] = max(c.peak_bytes.get(device, 0.0), after)
        if settings.memory is not None:
            c.fits = c.peak <= settings.memory
            if not c.fits and not c.why:
                c.why = f"needs {format_bytes(c.peak)} on one device ({dp} replicas, each holding its stages whole)"
    return choices


def replicas_note(best: Choice, link: float) -> str:
    """Why the best configuration has replicas: its all-reduce and what each device holds."""
    return (f"{best.replicas} replicas x {best.n_stages // max(1, best.kwargs.get('stages_per_rank', 1))} ranks "
            f"(fxpipe.distributed, mesh=('dp', 'pp'), data_parallel='ddp'): each replica steps on 1/{best.replicas} "
            f"of the batch; the gradients' all-reduce adds {format_seconds(getattr(best, 'allreduce_s', 0.0))} "
            f"per step at {link / 1e9:.3g} GB/s; each device holds its stages whole "
            f"({format_bytes(max(best.static_bytes.values(), default=0.0))} of parameters, gradients and optimizer "
            "state; data_parallel='fsdp' would shard them, and is not predicted here)")
