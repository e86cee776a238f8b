"""``Pipeline.step``: one training step, forward and backward, in the pipeline's schedule.

``pipe(x)`` returns the merged output, and the user's ``loss.backward()`` runs backward
after every forward: GPipe's order, the only one possible there. ``pipe.step(...)`` knows
each micro-batch's loss, so it can also run the 1F1B order (:mod:`fxpipe.runtime._orders`):
each micro-batch's backward as soon as its forward is done, holding fewer micro-batches'
activations. The loss of a micro-batch is either

* **the model's own** (``labels=`` losses): the 0-dim output merged with ``'mean'`` or
  ``'sum'`` (``output_merge=``), weighted exactly as the forward merges it (a mean over
  counted labels by each micro-batch's count, :mod:`fxpipe.checks._counted_labels`); or
* ``loss_fn(output)`` / ``loss_fn(output, target)``: the model's output structure of one
  micro-batch (a ``ModelOutput`` too), ``target`` split along dim 0 like the batch. With
  ``loss_reduction='mean'`` (a loss averaged over the micro-batch's samples) the step's loss
  is the mean weighted by micro-batch sizes, as eager's loss on the whole batch; with
  ``'sum'``, their sum (return a sum and divide by what the whole batch counts: any
  normalisation is then exact).

Either way the step's loss and every ``.grad`` are eager's on the whole batch. What could
be silently wrong is refused (:class:`~fxpipe.errors.StepError`): a merge that is not linear
in the losses, a ``'mean'`` ``loss_fn`` over labels holding ``-100`` (a token mean counts
them out, so micro-batches weigh differently), a target split along another dim than the
inputs', a step keyword the model's own ``forward`` also takes.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor

from .checks._loss_fn import Weights, own_loss_output
from .checks._targets import TargetCopies, split_target
from .capture._hooks import live_hook_kinds
from .errors import ArgumentError, StepError
from .runtime._batchnorm import commit_deferred_batch_norm, deferring
from .runtime._frontend import checkpoint_stop
from .runtime._microbatch import Batch
from .runtime._orders import FreshGradients, StepLosses, refuse_parameter_hooks

__all__ = ["run_step", "REDUCTIONS", "ReturnOutputs", "refuse_forward_with_grad"]

REDUCTIONS = ("mean", "sum")
#: ``step(return_outputs=...)``: False, True, or a callable on one micro-batch's output
ReturnOutputs = Union[bool, Callable[[Any], Any]]


def refuse_forward_with_grad(schedule: str, training: bool) -> None:
    """``pipe(x)`` in training mode with gradients under ``schedule='1f1b'``: its backward
    would be the user's, after every forward, i.e. GPipe's order holding every activation."""
    if schedule == "1f1b" and training and torch.is_grad_enabled():
        raise StepError(
            "this pipeline was built with schedule='1f1b', whose backward runs per micro-batch inside "
            "pipe.step(...); pipe(x) followed by loss.backward() can only run all forwards before any backward "
            "(GPipe's order, every micro-batch's activations held). Train with loss = pipe.step(x, loss_fn=..., "
            "target=y) (or pipe.step(**batch) for a model returning its loss), call pipe(x) under torch.no_grad() "
            "or in eval mode for outputs, or build with schedule='gpipe' to backward pipe(x) yourself.")


def run_step(pipe: Any, args: tuple, kwargs: dict, loss_fn: Optional[Callable[..., Tensor]],
             target: Any, reduction: Optional[str], given: Sequence[str],
             return_outputs: ReturnOutputs = False) -> Any:
    """One step of ``pipe`` (an :class:`fxpipe.Pipeline`); returns the step's loss (no grad),
    or ``(loss, outputs)`` with ``return_outputs`` (:class:`_Kept`).
    ``given``: the step keywords the caller passed (checked against the model's signature)."""
    _check_call(pipe, loss_fn, reduction, given)
    if pipe.schedule == "1f1b" and pipe.training:
        refuse_parameter_hooks(pipe.named_parameters(), "schedule='1f1b'")
    kept = _Kept(pipe, return_outputs)
    flat, micro, sizes, weights, batches = pipe._micro_batches(args, kwargs)
    m = len(batches)
    fn: Optional[_FnLoss] = None
    if loss_fn is None:
        if target is not None:
            raise ArgumentError("target= is given without loss_fn=: pass loss_fn(output, target), or leave target "
                                "out when the model returns its loss", argument="target")
        losses = _model_loss(pipe, sizes, weights, m)
    else:
        fn = _FnLoss(pipe, loss_fn, target, sizes, reduction)
        losses = fn.losses()
    losses.loss_of = kept.around(losses.loss_of, m)
    stop = checkpoint_stop(pipe.checkpoint, m, pipe.training)
    loss: Optional[Tensor] = None  # set where the loss is not the merge of the micro-batches'
    if pipe.schedule == "1f1b":
        grads = FreshGradients(pipe.parameters())
        try:
            with deferring(pipe._deferred), pipe.batching.naming_sizes(sizes):
                pipe._runtime.run(batches, stop, on_output=losses.backward_now)
        except BaseException as e:
            if losses.backwarded and grads.drop():  # eager fails before any backward: no .grad either
                e.add_note(f"fxpipe: {losses.backwarded} of {m} micro-batches had run their backward in this "
                           "1F1B step; their gradients were dropped (.grad is None again, as before the step).")
            elif losses.backwarded:
                e.add_note(f"fxpipe: {losses.backwarded} of {m} micro-batches had run their backward in this "
                           "1F1B step: .grad holds part of its gradients; zero them before another step.")
            raise
    else:
        with deferring(pipe._deferred), pipe.batching.naming_sizes(sizes):
            pipe._runtime.run(batches, stop)
        if fn is not None and not fn.decide(batches[0].values).kind:
            for i, b in enumerate(batches):
                kept.keep(i, b)
            whole = fn.whole(batches, weights)  # not proven per micro-batch: eager's loss on the merged output
            whole.backward()
            loss = whole.detach()
        else:
            losses.backward_all(batches)
    if fn is not None:
        fn.copies.write_back()
    if pipe.training:
        commit_deferred_batch_norm(pipe._deferred, len(batches), pipe.module)
    return kept.result(loss if loss is not None else losses.merged(), sizes, weights)


class _Kept:
    """``return_outputs``: each micro-batch's outputs, detached as they leave the last stage
    (its activations are freed as usual; only the outputs stay), merged as ``pipe(x)`` merges
    them (``True``), or ``fn(output)`` of each micro-batch, computed then under ``no_grad``
    so only its result stays (a callable: metrics without holding the logits)."""

    def __init__(self, pipe: Any, how: ReturnOutputs) -> None:
        if not (how is False or how is True or callable(how)):
            raise ArgumentError(f"return_outputs must be False, True or a callable taking one micro-batch's output, "
                                f"got {type(how).__name__}", argument="return_outputs")
        self.pipe, self.how = pipe, how
        self.values: List[Any] = []

    def around(self, loss_of: Callable[[int, Batch], Tensor], m: int) -> Callable[[int, Batch], Tensor]:
        if self.how is False:
            return loss_of
        self.values = [None] * m

        def keeping(i: int, out: Batch) -> Tensor:
            self.keep(i, out)
            return loss_of(i, out)

        return keeping

    def keep(self, i: int, out: Batch) -> None:
        if self.how is False or (self.values and self.values[i] is not None):
            return
        leaves = [v.detach() if isinstance(v, Tensor) else v for v in out.values]
        if self.how is True:
            self.values[i] = leaves
        else:
            with torch.no_grad():
                self.values[i] = self.how(self.pipe.capture.unflatten_output(leaves))

    def result(self, loss: Tensor, sizes: List[int], weights: dict) -> Any:
        if self.how is False:
            return loss
        if self.how is True:
            merged = self.pipe.batching.merge(self.values, sizes, weights)
            return loss, self.pipe.capture.unflatten_output(merged)
        return loss, list(self.values)


def _check_call(pipe: Any, loss_fn: Any, reduction: str, given: Sequence[str]) -> None:
    if not torch.is_grad_enabled():
        raise StepError("pipe.step() runs backward, and gradients are disabled here (torch.no_grad() or "
                        "torch.inference_mode()); call pipe(x) for outputs without gradients, or step outside it")
    hooked = live_hook_kinds(pipe)
    if hooked:  # they run around pipe(x), Module.__call__; step() calls no module, and skipped them (a trial)
        raise StepError(f"the pipeline has {' and '.join(hooked)}, which run around pipe(x) and not inside "
                        "pipe.step(), whose losses and backward run per micro-batch: the step would silently leave "
                        "them out. Remove them for step(), or train with loss_fn(pipe(x)).backward() (GPipe)")
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentError(f"loss_fn must be callable as loss_fn(output) or loss_fn(output, target), got "
                            f"{type(loss_fn).__name__}", argument="loss_fn")
    if reduction is not None and reduction not in REDUCTIONS:
        raise ArgumentError(f"loss_reduction must be None (read from loss_fn), 'mean' (loss_fn averages over the "
                            f"samples it counts) or 'sum' (it sums them), got {reduction!r}", argument="loss_reduction")
    try:
        params = inspect.signature(pipe.module.forward).parameters
    except (TypeError, ValueError):
        return
    clash = [k for k in given if k in params]
    if clash:
        raise ArgumentError(
            f"pipe.step() was given {', '.join(f'{k}=' for k in clash)}, which is step()'s own keyword, but "
            f"{type(pipe.module).__name__}.forward also takes an argument of that name: pass the model's "
            "argument positionally, so that step()'s keyword is not mistaken for it", argument=clash[0])


def _model_loss(pipe: Any, sizes: List[int], weights: dict, m: int) -> StepLosses:
    """The model's own loss output, merged as the forward merges it."""
    batching = pipe.batching
    names = batching.out_names
    k = own_loss_output(batching, "pipe.step() without loss_fn=", "Pass loss_fn=lambda out, y: ... with target=y")
    label = f"output {names[k]!r}" if names[k] else "the output"

    def loss_of(i: int, out: Batch) -> Tensor:
        return _checked(out.values[k], i, label)

    def merge(parts: List[Tensor]) -> Tensor:
        return batching._merge_leaf(k, parts, sizes, weights.get(k))

    return StepLosses(loss_of, merge, m)


class _FnLoss:
    """``loss_fn`` per micro-batch, merged by what it counts (:mod:`fxpipe.checks._loss_fn`).

    The weights are decided at the first micro-batch's output (its shapes are needed to read
    ``loss_fn``), before any backward runs. A loss not proven to split (an in-batch-negatives
    loss, an op the reading does not know) is computed on the merged output under GPipe, as
    ``loss_fn(pipe(x), y).backward()`` would; 1F1B, whose backwards cannot wait for every
    output, refuses it there.
    """

    def __init__(self, pipe: Any, loss_fn: Callable[..., Tensor], target: Any, sizes: List[int],
                 reduction: Optional[str]) -> None:
        self.pipe, self.loss_fn, self.target, self.sizes, self.reduction = pipe, loss_fn, target, sizes, reduction
        self.targets = None if target is None else _split_target(pipe.batching, target, sizes)
        self.reading = pipe._loss_reading(loss_fn)
        self.weights: Optional[Weights] = None
        self.copies = TargetCopies()  # each micro-batch's target, for loss_fn to write into

    def decide(self, first: Sequence[Any]) -> Weights:
        if self.weights is None:
            self.weights = self.reading.weights(list(first), self.targets, self.sizes)
            if self.weights.kind is not None and self.reduction not in (None, self.weights.kind):
                read = "a sum over its samples" if self.weights.kind == "sum" else "a mean over what it counts"
                raise StepError(
                    f"loss_reduction={self.reduction!r}, but loss_fn reads as {read} "
                    f"(loss_reduction={self.weights.kind!r}): the step would weigh its micro-batches otherwise "
                    "than the loss does on the whole batch. Leave loss_reduction out: fxpipe reads it from loss_fn")
        return self.weights

    def losses(self) -> StepLosses:
        def loss_of(i: int, out: Batch) -> Tensor:
            output = self.pipe.capture.unflatten_output(list(out.values))
            try:
                target = None if self.targets is None else self.copies(self.targets[i])
                loss = self.loss_fn(output) if target is None else self.loss_fn(output, target)
            except Exception as e:
                if i == 0 and not self.decide(out.values).kind:  # it fails on a micro-batch: say why first
                    raise StepError(
                        f"loss_fn fails on micro-batch 0 ({type(e).__name__}: {str(e).strip()[:200]}), and it is not "
                        f"proven to split over micro-batches: {self.weights.why if self.weights else ''}. Under "
                        "schedule='1f1b' each micro-batch's loss is computed on its own; build with schedule='gpipe' "
                        "(its step computes such a loss on the whole batch's output)") from e
                raise
            loss = _checked(loss, i, "loss_fn's result")
            if i == 0 and not self.decide(out.values).kind:
                raise StepError(
                    f"pipe.step(loss_fn=...) under schedule='1f1b' runs each micro-batch's backward before the next "
                    f"one's output exists, so loss_fn must split over micro-batches, and this one is not proven to: "
                    f"{self.weights.why if self.weights else ''}. Nothing has run backward yet. Build with "
                    "schedule='gpipe' (its step computes such a loss on the whole batch's output), or write the loss "
                    "as a sum over samples, or such a sum divided by a count of the target (a mask's sum, the labels "
                    "that are not ignore_index)")
            return loss

        def merge(parts: List[Tensor]) -> Tensor:
            assert self.weights is not None
            return self.weights.merge(parts)

        return StepLosses(loss_of, merge, len(self.sizes))

    def whole(self, batches: Sequence[Batch], weights: dict) -> Tensor:
        merged = self.pipe.batching.merge([b.values for b in batches], self.sizes, weights)
        output = self.pipe.capture.unflatten_output(merged)
        loss = self.loss_fn(output) if self.target is None else self.loss_fn(output, self.target)
        return _checked(loss, 0, "loss_fn's result on the whole batch")


def _split_target(batching: Any, target: Any, sizes: List[int]) -> List[Any]:
    other = sorted({d for d in batching.in_dims if d not in (None, 0)})
    if other:
        raise ArgumentError(
            f"target= is split along dim 0, but the inputs are split along {batching.dims_text()}: where the "
            "target's batch is cannot be told. Compute the loss in the model (labels=, output_merge={'loss': "
            "'mean'}) or move the target's batch to dim 0 and the inputs' too", argument="target")
    return split_target(target, sizes)


def _checked(loss: Any, i: int, what: str) -> Tensor:
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)}, {loss.dtype}" if isinstance(loss, Tensor) else type(loss).__name__
        raise StepError(f"{what} for micro-batch {i} must be a 0-dim floating tensor (a loss), got {got}")
    if not loss.requires_grad:
        raise StepError(f"{what} for micro-batch {i} does not require grad: no parameter it depends on requires "
                        "grad, or it was computed without gradients; nothing to backward")
    return loss
