"""The order of a training step: GPipe's fill-drain, or 1F1B.

``pipe(x)`` followed by ``loss.backward()`` can only run GPipe's order: backward starts when
the user calls it, after every micro-batch's forward, so each device holds the activations of
all ``m`` micro-batches at once. A step that knows the loss of each micro-batch
(``Pipeline.step``) can run **1F1B** instead: micro-batch ``i``'s backward runs as soon as its
forward left the last partition, before micro-batch ``i + n`` enters the first one, so
partition ``j`` holds at most ``n - j`` micro-batches' activations (``n`` partitions), however
many micro-batches the step has.

Both orders give the same result, because both differentiate the same sum:

* each micro-batch's loss ``L_i`` enters the step's loss through a merge that is linear in
  it (a mean weighted by sizes or by counted labels, or a sum), so the gradient that reaches
  ``L_i`` is the constant ``dmerge/dL_i``, computed once by autograd on the merge itself
  (:func:`loss_scales`) rather than re-derived here;
* GPipe: every forward, then one ``backward`` over all ``L_i`` with those gradients, in the
  order Fork/Join imposes (micro-batch ``i-1`` after ``i`` on each partition);
* 1F1B: ``backward(L_i, dmerge/dL_i)`` after the tick in which micro-batch ``i`` left the
  last partition (:meth:`~fxpipe.runtime._pipeline.PipelineRunner.run`'s ``on_output``), with
  no Fork/Join between micro-batches: each has its own graph. Forward ticks stay those of
  the clock cycles and checkpointed tasks restore their RNG states for recomputation, so
  every forward draws the same random numbers in both orders; gradients accumulate into
  ``.grad`` in micro-batch order rather than in reverse (float sums in another order).

What 1F1B gives up: its backward runs on the caller's thread between forward ticks, one
micro-batch through every partition, so on several devices a backward does not overlap the
other devices' forwards (on one device, nothing overlaps in either order). Its point is
memory, not speed.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..errors import ArgumentError, StepError
from ._microbatch import Batch

__all__ = ["SCHEDULES", "check_schedule", "loss_scales", "StepLosses", "FreshGradients", "refuse_parameter_hooks"]

#: the orders a pipeline's training step runs in; 'gpipe' (the paper's) is the default
SCHEDULES = ("gpipe", "1f1b")

LossOf = Callable[[int, Batch], Tensor]
Merge = Callable[[List[Tensor]], Tensor]


def check_schedule(schedule: object) -> str:
    if schedule not in SCHEDULES:
        raise ArgumentError(
            f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got schedule={schedule!r}; pass 'gpipe' "
            "(the default: all forwards, then backward) or '1f1b' (each micro-batch's backward as soon as its "
            "forward is done, in pipe.step(): less activation memory)", argument="schedule")
    return str(schedule)


def loss_scales(merge: Merge, m: int, like: Tensor) -> List[Tensor]:
    """``dmerge/dL_i`` for each of ``m`` micro-batch losses shaped and typed like ``like``.

    The merge is linear in the losses (the caller only passes such merges), so its gradient
    does not depend on their values: autograd takes it on stand-ins, giving exactly the
    gradient ``merge(losses).backward()`` would hand each loss.
    """
    stand_ins = [torch.ones_like(like, requires_grad=True) for _ in range(m)]
    with torch.enable_grad():
        merged = merge(stand_ins)
    grads = torch.autograd.grad(merged, stand_ins, allow_unused=True)
    return [torch.zeros_like(like) if g is None else g for g in grads]


class StepLosses:
    """The micro-batch losses of one step, and their backward in either order.

    ``loss_of(i, output)`` makes micro-batch ``i``'s 0-dim loss from its output batch;
    ``merge`` combines the ``m`` losses into the step's (linear in each).
    """

    def __init__(self, loss_of: LossOf, merge: Merge, m: int) -> None:
        self.loss_of = loss_of
        self.merge = merge
        self.m = m
        self.losses: List[Optional[Tensor]] = [None] * m  # detached, once computed
        self._scales: Optional[List[Tensor]] = None
        self._weighed: List[bool] = []  # per micro-batch: whether the merge gives its loss any weight
        #: micro-batches whose backward ran (1F1B): gradients are partly accumulated
        self.backwarded = 0

    def _loss(self, i: int, output: Batch) -> Tensor:
        loss = self.loss_of(i, output)
        self.losses[i] = loss.detach()
        if self._scales is None:
            self._scales = loss_scales(self.merge, self.m, loss.detach())
            # a micro-batch the merge weighs 0 (a mean over what it counts, counting nothing) runs
            # no backward: its loss is sum / 0, whose backward turns even a zero gradient into nan
            # in every parameter (measured); eager's whole-batch loss gives those terms nothing.
            # Where none counts anything, eager's 0 / 0 still backpropagates: every backward runs
            self._weighed = torch.stack(self._scales).reshape(self.m, -1).ne(0).any(1).tolist()
            if not any(self._weighed):
                self._weighed = [True] * self.m
        return loss

    def backward_now(self, i: int, output: Batch) -> Batch:
        """1F1B: micro-batch ``i``'s loss and backward; its output is dropped (returned empty)."""
        loss = self._loss(i, output)
        del output
        assert self._scales is not None
        if self._weighed[i]:
            torch.autograd.backward(loss, self._scales[i])
        self.backwarded += 1
        return Batch((), atomic=False)

    def backward_all(self, outputs: Sequence[Batch]) -> None:
        """GPipe: every micro-batch's loss, then one backward over all of them (those the merge weighs)."""
        losses = [self._loss(i, out) for i, out in enumerate(outputs)]
        assert self._scales is not None
        kept = [(loss, scale) for loss, scale, weighed in zip(losses, self._scales, self._weighed) if weighed]
        if kept:
            torch.autograd.backward([loss for loss, _ in kept], [scale for _, scale in kept])

    def merged(self) -> Tensor:
        """The step's loss (no grad): the merge of the micro-batch losses."""
        with torch.no_grad():
            return self.merge([x for x in self.losses if x is not None])


class FreshGradients:
    """Whether every trained parameter's ``.grad`` is None as a step begins (``zero_grad()``'s
    default). A step failing after some micro-batch's backward (1F1B, torch's schedules) left
    that part in ``.grad`` where eager fails before any backward, and a loop skipping the batch
    trained its next step 2.8e-2 off (a trial); both front doors call :meth:`drop` on failure."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self.trained = [p for p in params if p.requires_grad]
        self.fresh = all(p.grad is None for p in self.trained)

    def drop(self) -> bool:
        """After a failed step: every ``.grad`` None again where every one was; whether it was."""
        if self.fresh:
            for p in self.trained:
                p.grad = None
        return self.fresh


def refuse_parameter_hooks(named: Iterable[Tuple[str, Tensor]], what: str, gpipe: bool = True) -> None:
    """A backward per micro-batch (``what``: which schedule runs one) calls a parameter's
    gradient hooks once per micro-batch, on that micro-batch's part: ``p.register_hook(g.clamp)``
    clamps each part instead of the sum (a trial: gradients 2.6x off), and an optimizer stepped
    in ``register_post_accumulate_grad_hook`` steps once per micro-batch. Eager, and GPipe's one
    backward over every micro-batch, call them once. Refused before anything runs; ``gpipe``:
    whether building with ``schedule='gpipe'`` is a way out (one process: yes; on ranks every
    schedule of torch's runs a backward per micro-batch)."""
    for name, p in named:
        if p.requires_grad and (getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)):
            raise StepError(
                f"parameter {name!r} has a gradient hook (register_hook or register_post_accumulate_grad_hook), "
                f"and {what} runs one backward per micro-batch: the hook would be called once per micro-batch, "
                "on that micro-batch's part of the gradient, where eager calls it once on the sum, and the "
                "result would silently differ. What to do: "
                + ("build with schedule='gpipe' (one backward over every micro-batch), or " if gpipe else "")
                + "apply the hook's effect after the step (clip, scale or step the optimizer once .grad is "
                "complete) and remove the hook.")
