"""``data_parallel='fsdp'`` replicas, predicted: what one device holds, and what its collectives cost.

``fxpipe.distributed`` shards each rank's stage over the replicas with FSDP2
(:mod:`fxpipe.distributed._sharding`), as torch's own root FSDP module: ``reshard_after_forward``
is off for a root, so the whole parameters are all-gathered once, at the step's first
forward, and stay; the whole gradients are kept over every micro-batch and reduce-scattered
once, at the step's end (``perform_reduce_grad``). What a device holds, read in torch 2.13's
``_fsdp_collectives.py`` / ``_fsdp_param_group.py`` and measured (the CPU allocator's records
on 4 gloo ranks, 2 replicas x 2 stages, ``tests/tuning/test_tune_replicas.py``), with ``P``
its parameters' bytes, ``T`` those trained, ``dp`` the replicas:

* **always**: ``P / dp`` of sharded parameters, the optimizer's state over ``T / dp``, the
  buffers (not sharded) and the receive buffers; under ``zero_grad='in_place'`` also the
  sharded gradients, ``T / dp``;
* **through the step**: the whole parameters ``P`` (gathered) and, from each parameter's
  first backward on, its whole gradient (``T`` in all): the stage's gradients are made anew
  every step, FSDP setting them to None at its reduce-scatter, so they are walked as
  ``zero_grad='set_to_none'`` whatever the optimizer does. This ``P + T`` is reported with
  the static bytes;
* **two moments above that**, before any gradient and after the whole parameters are freed:
  the all-gather's flat output (``P``) beside the whole parameters it is copied into, ``2 P``
  (freed at the forward's end); and the reduce-scatter's flat input (``T``) beside the whole
  gradients it is copied from, ``2 T`` (the whole parameters were freed just before). Above
  the static bytes these are ``P - T`` and ``T - P``: only frozen parameters make the first
  count, and the second never does on NCCL. gloo's reduce-scatter also copies its input
  (measured: one more ``T`` while the sharded output ``T / dp`` exists), ``T / dp - (P - T)``
  above them: not counted here, tune predicts for NCCL.

So against ``'ddp'`` a device saves ``(dp - 1) / dp`` of the optimizer state and pays ``P / dp``
for the shards (and no all-reduce bucket): less memory where the optimizer's state is large
(Adam: twice the trained bytes), more with plain SGD.

**Time**: one ring all-gather of each stage's ``P`` and one ring reduce-scatter of ``T``, each
``(dp - 1) / dp`` of the bytes over ``link`` plus ``dp - 1`` latencies (together the bytes of
``'ddp'``'s ring all-reduce), neither overlapped with compute: a stage gathers when its first
micro-batch arrives, so the pipeline's fill waits for every stage's gather in turn; the
reduce-scatters run after each device's last backward, and the step ends when the slowest is done.
"""

from __future__ import annotations

from typing import Iterable, Sequence, Tuple

from ._memory import OPTIMIZER_STATES

__all__ = ["ring_seconds", "sharded_seconds", "sharded_memory"]


def ring_seconds(nbytes: float, dp: int, link: float, latency: float) -> float:
    """A ring all-gather (or reduce-scatter) of ``nbytes`` whole over ``dp`` ranks."""
    if nbytes <= 0 or dp < 2:
        return 0.0
    return (dp - 1) / dp * nbytes / link + (dp - 1) * latency


def sharded_seconds(stage_params: Sequence[float], device_trained: Iterable[float], dp: int, link: float,
                    latency: float) -> Tuple[float, float]:
    """(the gathers on the pipeline's fill, the slowest device's reduce-scatter): what FSDP adds
    to a step, given each stage's parameter bytes and each device's trained bytes."""
    gathers = sum(ring_seconds(p, dp, link, latency) for p in stage_params)
    reduce = max((ring_seconds(t, dp, link, latency) for t in device_trained), default=0.0)
    return gathers, reduce


def sharded_memory(whole_static: float, above: float, params: float, trained: float, dp: int, optimizer: str,
                   zero_grad: str) -> Tuple[float, float]:
    """(static bytes, peak bytes) of one device under ``'fsdp'``, from what it holds under
    ``'ddp'`` (``whole_static``: its stages whole with their gradients, optimizer state and
    receive buffers) and the walk's rise above that under ``zero_grad='set_to_none'``
    (``above``); ``params``, ``trained``: the bytes of its parameters FSDP shards (see the
    module docstring; a weight two of its stages share stays whole, in ``whole_static``)."""
    state = OPTIMIZER_STATES[optimizer] * trained
    static = whole_static + params / dp - (dp - 1) / dp * state
    if zero_grad == "in_place":  # the sharded gradients stay between steps
        static += trained / dp
    return static, static + max(above, params - trained, trained - params)
