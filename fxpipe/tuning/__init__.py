"""``fxpipe.tuning``, behind ``fxpipe.tune(...)``: pick stages, micro-batches, schedule and checkpointing for given devices
and memory, predicted by simulating each configuration.

The parts, each a private module with one job:

* :mod:`._nodes`: one recorded forward, storage by storage (what each node makes, reads,
  saves for backward; its FLOPs);
* :mod:`._activations`: per stage, one micro-batch's activation bytes (held, and at the peak
  of its backward), with and without checkpointing;
* :mod:`._costs`: per stage, one micro-batch's forward / input-gradient / weight-gradient time,
  measured or from a roofline;
* :mod:`._orders`: the action list of each device (fxpipe.pipeline's clock cycles, torch's
  schedule tables);
* :mod:`._simulate`: an action list timed: step time and bubble;
* :mod:`._memory`: memory per device along the action list, plus parameters, gradients,
  optimizer state and receive buffers;
* :mod:`._device_memory`: one candidate's memory per device (front door, ``zero_grad``);
* :mod:`._data_parallel`: ``dp x pp`` replicas, ``'ddp'`` and ``'fsdp'``; :mod:`._sharded`:
  what ``'fsdp'`` holds per device and what its collectives cost;
* :mod:`._search`: the candidates, each predicted, and their ranking (its timing half:
  :mod:`._search_timing`, stages timed interleaved, the loss); :mod:`._result`: the
  :class:`Tuning` it returns; :mod:`._api`: :func:`tune`; :mod:`._units`: ``'80GiB'``.

Sits with the front doors: it uses :mod:`fxpipe.plan` and :mod:`fxpipe.build`.
"""

from __future__ import annotations

from ._api import SCHEDULES, tune
from ._result import Choice, Tuning

__all__ = ["tune", "Tuning", "Choice", "SCHEDULES"]
