"""One candidate's memory per device: static bytes and the rise above them, from the walk.

Split out of :mod:`._search` (which ranks candidates) because what a step keeps depends on
the front door and on how ``.grad`` is cleared, and that reasoning belongs together:

* ``fxpipe.pipeline``'s GPipe runs one autograd call over every micro-batch: each parameter's
  gradients are summed before ``.grad`` (``grad_buffers`` where ``.grad`` is kept through the
  backward; with ``set_to_none`` the sum becomes it). Its 1F1B and ``fxpipe.distributed`` run
  one call per micro-batch, into ``.grad``.
* ``zero_grad='set_to_none'``: no ``.grad`` before the step; each stage's gradients appear at
  its first backward (``grads_made``) and stay. They are still reported with the static bytes
  (parameters, gradients, optimizer state), and the activations as the peak above those, so
  that the two add up to the peak either way.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Mapping, Sequence, Tuple, Union

from ._activations import StageActivations
from ._loss_memory import DEFAULT as DEFAULT_LOSS
from ._loss_memory import LossMemory
from ._memory import TorchRun, activation_peaks, receive_buffers, static_bytes
from ._orders import Action

__all__ = ["device_memory"]


def device_memory(orders: Mapping[Hashable, Sequence[Action]], acts: Sequence[StageActivations], mode: str,
                  chunks: int, *, gpipe: bool, run: Union[bool, TorchRun], params: Sequence[int],
                  trained: Sequence[int], where: List[Hashable], optimizer: str,
                  zero_grad: str, loss: LossMemory = DEFAULT_LOSS) -> Dict[Hashable, Tuple[float, float]]:
    """Per device: (static bytes, activation bytes above them at the peak). ``gpipe``:
    ``fxpipe.pipeline``'s GPipe (merged output, one backward); ``run``: False in one process,
    else how torch runs the stages (:func:`._memory.torch_run`); ``params``, ``trained``: per
    stage, each tensor once per device (:func:`._tensors.once_per_device`); ``loss``: the
    loss after the model, measured on one micro-batch (:mod:`._loss_memory`)."""
    kept = zero_grad == "in_place"
    peaks = activation_peaks(orders, acts, mode, chunks, merged_output=gpipe, torch_stages=run,
                             grad_buffers=trained if gpipe and kept else None,
                             grads_made=None if kept else trained, step_loss=not gpipe and not run,
                             loss=loss)
    if run:
        static = static_bytes(params, where, optimizer, receive=receive_buffers(acts, run), chunks=chunks,
                              trained=trained)
    else:
        static = static_bytes(params, where, optimizer, trained=trained)
    grads = {} if kept else static_bytes([0] * len(where), where, "none", trained=trained)  # made in the step
    return {d: (float(static.get(d, 0)), float(peaks.get(d, 0) - grads.get(d, 0))) for d in orders}
