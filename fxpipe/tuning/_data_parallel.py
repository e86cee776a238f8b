"""``dp x pp`` for ``N`` devices: replicas of a shorter pipeline, each on its share of the batch.

``fxpipe.distributed`` runs ``dp`` replicas of a ``pp``-rank pipeline on a ``('dp', 'pp')``
mesh, each replica's stages whole (``data_parallel='ddp'``) or sharded over the replicas
(``'fsdp'``). A replica is an ordinary pipeline of ``N / dp`` devices stepping on
``batch / dp`` samples, so its time and memory are predicted by the same search
(:class:`._search.Search`, on the first ``pp`` devices), and each configuration is proposed
twice, once per ``data_parallel``, with what that adds:

* ``'ddp'`` (:mod:`fxpipe.distributed._replicas`): after the schedule, each device's gradients
  are all-reduced over the replicas once, not overlapped with compute. A ring all-reduce sends
  ``2 (dp - 1) / dp`` times the bytes over the link, plus ``2 (dp - 1)`` latencies per 25 MiB
  bucket; the step ends when the slowest device is done. Memory: each device holds its stages
  whole (parameters, gradients and optimizer state of a ``pp``-stage pipeline); the
  all-reduce's flat bucket (at most 25 MiB) comes on top of them after the activations are gone.
  Under ``zero_grad='in_place'`` the ``.grad`` held before the step is set aside
  (:mod:`fxpipe.distributed._set_aside`) and the step's own gradients are made beside it.
* ``'fsdp'`` (:mod:`._sharded`): one all-gather of the parameters at the step's first forward
  and one reduce-scatter of the gradients at its end, the same bytes over the link as the
  all-reduce, the gathers on the pipeline's fill; a device holds ``1/dp`` of its parameters
  and optimizer state between steps, and the whole parameters and gradients during the step.
  A weight two stages of one rank share (a tied embedding and head under a V schedule) is
  left whole on every rank by ``fxpipe.distributed``, and predicted so: with its optimizer
  state, as under ``'ddp'``, and neither gathered nor sharded.

The link is ``link=``: between replicas on other hosts it is the network's, usually slower
than the one between a host's devices.

Why replicas can win: a shorter pipeline has a smaller bubble at the same micro-batch count,
and each replica's micro-batches are ``dp`` times smaller; what they cost is the collectives
and, under ``'ddp'``, whole copies of the stages. ``'fsdp'`` is slower by its gathers on the
fill and lighter where the optimizer's state outweighs a shard of the parameters: it is
ranked first only where it fits and ``'ddp'`` does not, or runs as fast.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Sequence

from ..build import Checked
from ..distributed._replicas import BUCKET_BYTES
from ..distributed._sharding import used_twice_on_a_rank
from ._result import Choice
from ._search import Search, Settings
from ._sharded import sharded_memory, sharded_seconds
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
    """The distributed configurations of ``dp`` replicas of a ``N / dp``-device pipeline, each
    with ``data_parallel='ddp'`` and, where the schedule allows it, ``'fsdp'`` (``shared``: the
    search over all ``N`` devices, whose recordings per size are reused)."""
    pp = len(settings.devices) // dp
    batch = settings.batch // dp
    sub = dataclasses.replace(
        settings, devices=list(settings.devices[:pp]), batch=batch,
        schedules=[s for s in settings.schedules if s != "gpipe"],
        chunks=[c for c in settings.chunks if batch % c == 0] or [1],
        torch_devices=list(settings.torch_devices[:pp]) if settings.torch_devices is not None else None)
    search = Search(model, checked, sub, progress, shared=shared)
    choices = []
    for c in search.run():
        if not c.distributed:
            continue
        c.replicas = dp
        if c.peak_bytes and c.plan is not None:
            # (one refused before it was predicted is listed once); made before _ddp adds its all-reduce to c
            choices.append(_fsdp(search, c, dp))
        _ddp(search, c, dp)
        choices.append(c)
    return choices


def _fits(c: Choice, memory: Optional[float], held: str) -> None:
    """Whether ``c`` fits ``memory`` now that its replicas' memory is added, and if not, why."""
    if memory is None or not c.peak_bytes:
        return
    c.fits = c.peak <= memory
    c.why = ""
    if not c.fits:
        worst = max(c.peak_bytes, key=c.peak_bytes.__getitem__)
        c.why = (f"needs {format_bytes(c.peak)} on device {worst} ({c.replicas} replicas, {held}: parameters, "
                 f"gradients and optimizer state {format_bytes(c.static_bytes[worst])}, activations "
                 f"{format_bytes(c.activation_bytes[worst])})")


def _ddp(search: Search, c: Choice, dp: int) -> None:
    """``'ddp'``: the all-reduce after the schedule, and its bucket after the activations."""
    c.kwargs["data_parallel"] = "ddp"
    if not c.peak_bytes or c.plan is None:  # refused before it was predicted: nothing to add
        return
    _, where = search.layout(c.schedule)
    _, trained = once_per_device(search.tensors(c.plan), where)
    grads: dict = {}
    for stage, device in enumerate(where):
        grads[str(device)] = grads.get(str(device), 0) + trained[stage]
    reduce_s = max(allreduce_seconds(b, dp, search.s.link, search.s.latency) for b in grads.values())
    c.step_s += reduce_s
    c.allreduce_s = reduce_s
    # zero_grad='in_place': the .grad held before the step is set aside (ReplicaGradients), and
    # the step's own gradients are made beside it, as under 'set_to_none' (measured: 'ddp' held
    # one more copy of the gradients than the walk with .grad kept through the step)
    aside = search.s.zero_grad == "in_place"
    walked = search.memory(c, "set_to_none") if aside else {}
    for device, nbytes in grads.items():
        fresh = nbytes if aside else 0
        if aside:
            c.activation_bytes[device] = fresh + walked[device][1]
            c.peak_bytes[device] = c.static_bytes[device] + c.activation_bytes[device]
        after = c.static_bytes.get(device, 0.0) + fresh + min(BUCKET_BYTES, nbytes)
        c.peak_bytes[device] = max(c.peak_bytes.get(device, 0.0), after)
    _fits(c, search.s.memory, "data_parallel='ddp': each device holding its stages whole")


def _fsdp(search: Search, whole: Choice, dp: int) -> Choice:
    """The ``'fsdp'`` twin of a predicted replica configuration (:mod:`._sharded`)."""
    assert whole.plan is not None
    c = dataclasses.replace(whole, kwargs={**whole.kwargs, "data_parallel": "fsdp"},
                            peak_bytes={}, static_bytes={}, activation_bytes={})
    _, where = search.layout(c.schedule)
    tensors = search.tensors(whole.plan)
    parameters = {id(p) for p in search.checked.capture.graph_module.parameters()}
    # a weight two stages of one device share stays whole on every rank, with its optimizer
    # state: counted as 'ddp' counts it (in whole.static_bytes), and neither gathered nor sharded
    sharded = parameters - used_twice_on_a_rank((device, [k for k in found if k in parameters])
                                                for found, device in zip(tensors, where))
    params, trained = once_per_device(tensors, where, only=sharded)
    per_device: dict = {}
    for stage, device in enumerate(where):
        p, t = per_device.get(str(device), (0, 0))
        per_device[str(device)] = (p + params[stage], t + trained[stage])
    gathers, reduce = sharded_seconds(params, [t for _, t in per_device.values()], dp, search.s.link,
                                      search.s.latency)
    c.step_s = whole.step_s + gathers + reduce
    c.allreduce_s = gathers + reduce
    walked = search.memory(c, "set_to_none")  # the whole gradients are made anew every step
    for device, (p, t) in per_device.items():
        static, peak = sharded_memory(whole.static_bytes[device], walked[device][1], p, t, dp, search.s.optimizer,
                                      search.s.zero_grad)
        c.static_bytes[device], c.activation_bytes[device] = static, walked[device][1]
        c.peak_bytes[device] = peak
    _fits(c, search.s.memory, f"data_parallel='fsdp': 1/{dp} of the stages between steps, whole during one")
    return c


def replicas_note(best: Choice, choices: Sequence[Choice], link: float) -> str:
    """Why the best configuration has replicas, and why this ``data_parallel``: its collectives,
    what each device holds, and the other kind's prediction for the same configuration."""
    mode = best.kwargs.get("data_parallel", "ddp")
    ranks = best.n_stages // max(1, best.kwargs.get("stages_per_rank", 1))
    head = (f"{best.replicas} replicas x {ranks} ranks (fxpipe.distributed, mesh=('dp', 'pp'), "
            f"data_parallel={mode!r}): each replica steps on 1/{best.replicas} of the batch; ")
    if mode == "fsdp":
        head += (f"the parameters' all-gather and the gradients' reduce-scatter add "
                 f"{format_seconds(best.allreduce_s)} per step at {link / 1e9:.3g} GB/s; each device holds 1/"
                 f"{best.replicas} of its stages' parameters and optimizer state, and the whole parameters and "
                 f"gradients during the step ({format_bytes(best.peak)} at its peak)")
    else:
        head += (f"the gradients' all-reduce adds {format_seconds(best.allreduce_s)} per step at "
                 f"{link / 1e9:.3g} GB/s; each device holds its stages whole "
                 f"({format_bytes(max(best.static_bytes.values(), default=0.0))} of parameters, gradients and "
                 "optimizer state)")
    other = next((c for c in choices if c is not best and c.replicas == best.replicas
                  and c.schedule == best.schedule and c.chunks == best.chunks and c.checkpoint == best.checkpoint
                  and c.kwargs.get("data_parallel") not in (None, mode)), None)
    if other is None:
        return head + (f"; data_parallel='fsdp' is not proposed with {best.schedule!r}: fxpipe.distributed does "
                       f"not shard {best.kwargs.get('stages_per_rank', 1)} stages per rank" if mode == "ddp" else "")
    name = other.kwargs["data_parallel"]
    if not other.fits:
        why = f"needs {format_bytes(other.peak)} per device, more than the memory given"
    elif other.step_s > best.step_s:
        why = (f"{format_bytes(other.peak)} per device, and slower: "
               f"{format_seconds(other.step_s - best.step_s)} more per step")
    else:
        why = f"as fast, {format_bytes(other.peak)} per device"
    return f"{head}; data_parallel={name!r} instead: {why}"
