"""The loss torch.distributed.pipelining calls per micro-batch, weighted as ``loss_fn`` counts.

torch's schedules call ``loss_fn(output, target)`` on the last stage once per micro-batch and
backward each result: the step's gradients are the sum of those backwards. For the step to be
eager's on the whole batch, each micro-batch's loss is scaled by its weight in the whole
batch's loss: ``1`` for a sum over samples, ``n_i / sum_j n_j`` for a mean over what it counts
(samples, the labels a cross entropy counts after its own shift, a mask's sum, the targets'
class weights). The weights come from reading ``loss_fn`` (:mod:`fxpipe.checks._loss_fn`),
one process or several alike, on the last stage's output shapes from the build's fake run.

:meth:`StepLoss.begin` reads and weighs on the last stage's rank before anything is sent,
inside the step's agreement, so a loss that cannot be split (in-batch negatives) is a
:class:`~fxpipe.errors.StepError` on that rank and a named ``PeerFailedError`` on the others,
with the pipeline still usable.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from fxpipe.checks._loss_fn import LossFnReading, Weights
from fxpipe.errors import DistributedError, StepError

__all__ = ["StepLoss"]


class StepLoss:
    """``loss_fn`` per micro-batch of one step, scaled by its weight (see the module docstring).

    Args:
        loss_fn: the user's ``loss_fn(output, target)``.
        reading: its reading (:class:`LossFnReading`).
        outputs: the last stage's flat outputs of one micro-batch (meta tensors).
        chunks: micro-batches per step (equal sizes).
        device: where the last stage runs (the fake tensors of the reading are made there).
    """

    def __init__(self, loss_fn: Callable[..., Tensor], reading: LossFnReading, outputs: Sequence[Any],
                 chunks: int, device: torch.device) -> None:
        self.loss_fn = loss_fn
        self.reading = reading
        self.outputs = list(outputs)
        self.chunks = chunks
        self.device = device
        self.weights: Optional[Weights] = None
        self._targets: list[Tensor] = []
        self._next = 0

    def begin(self, target: Tensor) -> None:
        """Reads ``loss_fn`` on this step's micro-batch targets and fixes their weights; on the
        last stage's rank only, before the schedule runs."""
        size = target.size(0) // self.chunks
        sizes = [size] * self.chunks
        self._targets = list(target.split(sizes))
        self._next = 0
        weights = self.reading.weights(self.outputs, self._targets, sizes, device=self.device)
        if weights.kind is None:
            raise StepError(
                "loss_fn cannot be split over micro-batches: torch's schedules compute it on each micro-batch and "
                f"backward each at once, and this one is not proven to add up to the whole batch's loss: "
                f"{weights.why}. Nothing was sent. Write the loss as a sum over samples, or such a sum divided by a "
                "count of the target (a mask's sum, the labels that are not ignore_index), or compute a loss that "
                "mixes the samples outside the pipeline (eval_step gives the outputs)")
        self.weights = weights

    def __call__(self, output: Any, target: Tensor) -> Tensor:
        i = self._next
        self._next += 1
        if self.weights is None or i >= len(self._targets) or target.shape != self._targets[i].shape:
            raise DistributedError(f"the schedule asked for the loss of micro-batch {i} of {self.chunks}, out of the "
                                   "order fxpipe weighs them in (0, 1, ...): the step cannot stay exact")
        loss = self.loss_fn(output, target)
        if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            got = f"shape {tuple(loss.shape)}, {loss.dtype}" if isinstance(loss, Tensor) else type(loss).__name__
            raise StepError(f"loss_fn for micro-batch {i} must return a 0-dim floating tensor (a loss), got {got}")
        if self.weights.kind == "sum":
            return loss
        assert self.weights.counts is not None
        counts = self.weights.counts
        n = counts[i].to(loss.device)
        share = (n / torch.stack(counts).sum().to(loss.device)).to(loss.dtype)
        # a micro-batch counting nothing has the mean 0/0: weight 0, and a zero gradient
        return torch.where(n > 0, loss * share, torch.zeros_like(loss))
