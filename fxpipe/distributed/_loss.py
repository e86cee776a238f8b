"""The loss torch.distributed.pipelining calls per micro-batch, weighted as the loss counts.

torch's schedules call ``loss_fn(output, target)`` on the last stage once per micro-batch and
backward each result: the step's gradients are the sum of those backwards. For the step to be
eager's on the whole batch, each micro-batch's loss is scaled by its weight in the whole
batch's loss: ``1`` for a sum over samples, ``n_i / sum_j n_j`` for a mean over what it counts
(samples, the labels a cross entropy counts after its own shift, a mask's sum, the targets'
class weights). One process and several use one analysis:

* a user's ``loss_fn`` is read from its own graph (:mod:`fxpipe.checks._loss_fn`), on the last
  stage's output shapes from the build's fake run;
* the model's own loss (``loss_fn=None``: the 0-dim output merged with ``'mean'`` or ``'sum'``,
  transformers' ``labels=``) is weighed as ``fxpipe.pipeline`` merges it: a counted mean by
  each micro-batch's count of what it divides by (:mod:`fxpipe.checks._counted_labels`, the
  graph's own code run on the micro-batches' inputs), another mean by ``1 / chunks``.

:meth:`StepLoss.begin` weighs on the last stage's rank before anything is sent, inside the
step's agreement, so a loss that cannot be split (in-batch negatives) is a
:class:`~fxpipe.errors.StepError` on that rank and a named ``PeerFailedError`` on the others,
with the pipeline still usable.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fxpipe.checks._batching import Batching
from fxpipe.checks._loss_fn import LossFnReading, own_loss_output
from fxpipe.checks._targets import TargetCopies
from fxpipe.checks._loss_keys import loss_key
from ._loss_shapes import loss_fn_key, loss_only_inputs, own_loss_key
from fxpipe.errors import DistributedError, StepError

__all__ = ["StepLoss", "refuse_parameters_read"]


class StepLoss:
    """Each micro-batch's loss of one step, scaled by its weight (see the module docstring).

    Args:
        loss_fn: the user's ``loss_fn(output, target)``, or None for the model's own loss.
        reading: makes ``loss_fn``'s reading (:class:`LossFnReading`), when given: read again
            whenever what ``loss_fn`` reads changed (:attr:`reading`).
        outputs: the last stage's flat outputs of one micro-batch (meta tensors).
        batching: how the model's inputs split and outputs merge.
        chunks: micro-batches per step (equal sizes).
        device: where the last stage runs.
        replicated: each step is one data-parallel replica's part of the global batch: every
            micro-batch is counted (one alone too), and the loss's further counts are reported
            in :attr:`ratios` for the replicas to compare (:mod:`._failures`).
    """

    def __init__(self, loss_fn: Optional[Callable[..., Tensor]], reading: Optional[Callable[[], LossFnReading]],
                 outputs: Sequence[Any], batching: Batching, chunks: int, device: torch.device,
                 replicated: bool = False, graph: Optional[Any] = None) -> None:
        self.loss_fn = loss_fn
        self._make_reading = reading
        self._readings: Dict[Any, LossFnReading] = {}  # by loss_key: a few, the latest last
        self.outputs = list(outputs)
        self.batching = batching
        self.chunks = chunks
        self.device = device
        self.own = own_loss_output(batching, "loss_fn=None", "Pass loss_fn=...") if loss_fn is None else None
        #: the flat inputs only the own loss reads (its labels), for what its mean is over
        self.loss_inputs = loss_only_inputs(graph, self.own) if self.own is not None and graph is not None else []
        self.replicated = replicated
        #: this step's further counts of a loss adding several means, against its first (see Weights)
        self.ratios: tuple[float, ...] = ()
        #: where a count is the samples, standing for positions: the shapes it stands for
        #: (:func:`._loss_shapes.shape_key`), which the replicas must share; else None
        self.shape: Optional[int] = None
        self._counts: Optional[Tensor] = None  # what each micro-batch counts (float64); None: a sum
        self._shares: Optional[List[Tensor]] = None  # None: a sum, each micro-batch's loss as it is
        self._weighed: List[bool] = []  # per micro-batch: whether it counts anything
        self._nothing = False  # the step's whole (global) batch counts nothing
        self._targets: List[Any] = []  # this step's, per micro-batch
        #: the trainable parameters loss_fn reads, as of this step's reading, and what refuses
        #: those the rank cannot train (:func:`refuse_parameters_read`, set by the pipeline)
        self.parameters_read: List[Tensor] = []
        self.refuse_read: Optional[Callable[[List[Tensor]], None]] = None
        self.copies = TargetCopies()  # what loss_fn is given of them, written back after the step
        self._next = 0
        #: ``step(return_outputs=...)``: False, True (each micro-batch's flat outputs, detached),
        #: or a callable applied to each micro-batch's output; what was kept this step
        self.keep: Any = False
        self.kept: List[Any] = []
        #: this step's counts per counted 'mean' output (the model's own loss: read by begin), by
        #: which ``step(return_outputs=True)`` merges the kept outputs as eval_step would
        self.merge_weights: Optional[Dict[int, List[Tensor]]] = None


    @property
    def reading(self) -> Optional[LossFnReading]:
        """``loss_fn``'s reading for the loss it computes now: made again when what it reads
        changed since (a class-weight tensor reassigned, a criterion's reduction switched:
        :func:`fxpipe.checks._loss_keys.loss_key`), as :class:`fxpipe.Pipeline` does; read once
        at the build it weighed every later step as the first (a trial: 31% off)."""
        if self.loss_fn is None or self._make_reading is None:
            return None
        key = loss_key(self.loss_fn)
        reading = self._readings.pop(key, None) or self._make_reading()
        self._readings[key] = reading
        while len(self._readings) > 8:
            del self._readings[next(iter(self._readings))]
        return reading
    def begin(self, targets: Optional[List[Any]], flat: Sequence[Any]) -> None:
        """Fixes this step's weights from its micro-batches (``targets``, one per micro-batch,
        and the model's flat inputs ``flat`` for its own loss); on the last stage's rank only,
        before the schedule. torch's schedule is then given a stand-in target: the loss takes
        each micro-batch's from here, so a target may be a tuple or dict of tensors."""
        sizes = [next(x.size(0) for x in flat if isinstance(x, Tensor) and x.dim() > 0) // self.chunks] * self.chunks
        self._next = 0
        self._targets = []
        self.kept = []
        self.ratios = ()
        self.shape = None
        self.merge_weights = None
        if self.own is not None:
            merge = self.batching.merges[self.own]
            micro, _ = self.batching.split(flat, self.chunks)
            # refuses what it cannot weigh
            self.merge_weights = self.batching.weights(flat, micro, alone=not self.replicated)
            counts = self.merge_weights.get(self.own)
            if merge == "sum":
                self._weigh(None)
            elif counts is not None:
                self._weigh(_counted(counts))
            else:  # a plain mean of the micro-batches' means: weighed by samples, as replicas' may differ
                self._weigh(torch.tensor(sizes, dtype=torch.float64))
                self.shape = own_loss_key(flat, [o for i, o in enumerate(self.outputs) if i != self.own],
                                          [flat[k] for k in self.loss_inputs if k < len(flat)])
            return
        reading = self.reading
        assert targets is not None and reading is not None
        self._targets = [pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, Tensor) else t, part)
                         for part in targets]
        weights = reading.weights(self.outputs, self._targets, sizes, device=self.device,
                                       alone=not self.replicated)
        self.parameters_read = list(reading.parameters.values())
        if self.refuse_read is not None and self.parameters_read:  # before any other refusal: the reason
            self.refuse_read(self.parameters_read)
        if weights.kind is None and weights.why.startswith("loss_fn could not be run"):
            raise StepError(  # a failure, not a form: said as one (a trial read a target's wrong length as a split)
                f"{weights.why}. Nothing was sent. Where the target does not fit the outputs (its length, its "
                "classes), eager raises the same on this batch: pass the batch's own target. Where loss_fn reads "
                "values (.item(), a size the data decides), fake tensors hold none: compute that part from the "
                "model's outputs in its forward, or outside the pipeline (eval_step gives the outputs)")
        if weights.kind is None:
            raise StepError(
                "loss_fn cannot be split over micro-batches: torch's schedules compute it on each micro-batch and "
                f"backward each at once, and this one is not proven to add up to the whole batch's loss: "
                f"{weights.why}. Nothing was sent. Write the loss as a sum over samples, or such a sum divided by a "
                "count of the target (a mask's sum, the labels that are not ignore_index), or compute a loss that "
                "mixes the samples outside the pipeline (eval_step gives the outputs)")
        self._weigh(None if weights.kind == "sum" else _counted(weights.counts or []))
        self.ratios = weights.ratios
        if weights.by_samples:
            self.shape = loss_fn_key(self.outputs, self._targets)

    def _weigh(self, counts: Optional[Tensor]) -> None:
        """This step's counts (None: a sum), each micro-batch's share of them, and which count
        anything (read once per step: one sync, not one per micro-batch)."""
        self._counts = counts
        self._shares = _shares(counts)
        self._weighed = [True] * self.chunks if counts is None else (counts != 0).tolist()
        self._nothing = counts is not None and not any(self._weighed)

    def over_replicas(self, replicas: dist.ProcessGroup) -> None:
        """Each micro-batch's share of the *global* batch's count: this step's counts summed
        over the replicas (:mod:`._replicas`; one all-reduce among the last stages' ranks, after
        every rank agreed on the batch). A sum needs none, but takes part alike."""
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self._counts is not None:
            total += self._counts.sum().to(self.device)
        dist.all_reduce(total, group=replicas)
        if self._counts is not None:
            self._shares = list(self._counts / total.to(self._counts.device))
            self._nothing = not bool(total != 0)

    def __call__(self, flat_output: Callable[[], List[Any]], structured: Callable[[], Any], target: Any) -> Tensor:
        """Micro-batch ``i``'s scaled loss (the schedule asks in order 0, 1, ...); the output
        is given lazily, flat or in the model's structure."""
        i = self._next
        self._next += 1
        if self.keep is not False and i < self.chunks:
            leaves = [v.detach() if isinstance(v, Tensor) else v for v in flat_output()]
            if self.keep is True:
                self.kept.append(leaves)
            else:
                with torch.no_grad():
                    self.kept.append(self.keep(structured()))
        if i >= self.chunks:
            raise DistributedError(f"the schedule asked for the loss of micro-batch {i} of {self.chunks}: more than "
                                   "the step has, so the step cannot stay exact")
        if self.own is not None:
            loss = flat_output()[self.own]
            what = f"the model's own loss (output {self.batching.out_names[self.own]!r})"
        else:
            assert self.loss_fn is not None
            loss = self.loss_fn(structured(), self.copies(self._targets[i]))  # torch's own `target` is a stand-in
            what = "loss_fn"
        if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            got = f"shape {tuple(loss.shape)}, {loss.dtype}" if isinstance(loss, Tensor) else type(loss).__name__
            raise StepError(f"{what} for micro-batch {i} must be a 0-dim floating tensor (a loss), got {got}")
        if self._shares is None:
            return loss
        if self._nothing:  # the whole batch counts nothing: eager's 0 / 0, nan, backwarded as it is
            return loss * torch.zeros((), dtype=loss.dtype, device=loss.device)
        if not self._weighed[i]:  # a mean counting nothing: 0 / 0
            return _no_weight(loss, flat_output())
        return loss * self._shares[i].to(loss.device, loss.dtype)


def _no_weight(loss: Tensor, outputs: Sequence[Any]) -> Tensor:
    """The loss of a micro-batch the step weighs 0 (a mean counting nothing: ``sum / 0``), as
    torch's stage backward takes it: 0, reaching the stage's other outputs (its logits) with a
    zero gradient. Through the loss itself even a zero gradient is 0 * (1 / 0) = nan in every
    parameter (measured); eager's whole-batch loss gives those terms nothing (their mask or
    class weight is 0). A stage with no such output keeps that path: ``where``."""
    others = [v for v in outputs if isinstance(v, Tensor) and v is not loss and v.requires_grad
              and v.is_floating_point() and v.dim() > 0]  # not a 0-dim loss of the model's: sum / 0 too
    if not others:
        return torch.where(torch.zeros((), dtype=torch.bool, device=loss.device), loss, torch.zeros_like(loss))
    return sum(((v * 0).sum() for v in others), torch.zeros((), dtype=loss.dtype, device=loss.device))


def _counted(counts: Sequence[Tensor]) -> Tensor:
    return torch.stack([torch.as_tensor(c).detach().to(torch.float64) for c in counts])


def _shares(counts: Optional[Tensor]) -> Optional[List[Tensor]]:
    """Each micro-batch's share of the step's count; None: a sum, each loss as it is."""
    return None if counts is None else list(counts / counts.sum())


def refuse_parameters_read(read: Iterable[Tensor], held: Sequence[Tuple[str, Tensor]], model: nn.Module,
                           sharded: bool, replicated: bool) -> None:
    """Refuses (before anything is sent) a ``loss_fn`` that reads a trainable parameter this
    rank's stages do not hold as a whole tensor: ``held``, this rank's ``named_parameters()``.

    A parameter no stage uses (a learnable temperature in the loss) is trained by the last
    stage's rank alone: it is in no rank's ``pipe.parameters()``, ``pipe.clip_grad_norm_`` leaves
    it out, the other ranks' ``pipe.state_dict()`` hold it untrained, and replicas never sum its
    gradient (a trial: all silent, 1.6e-3 off after three steps). One another rank's stage holds
    is on meta here; under ``'fsdp'`` one this rank holds is a shard outside the forward (both
    failed inside torch). A parameter of the loss's own (a loss module's temperature, a frozen
    feature network, a teacher) is the caller's to train on the last stage's rank, as in one
    process: refused only across data-parallel replicas, which would each train their own, and
    under a zero-bubble schedule, whose weight pass covers the stages' parameters alone (a
    review: such a temperature got no gradient at all)."""
    mine = {id(p) for _, p in held}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for p in read:
        name = names.get(id(p))
        said = f"the model's parameter {name!r}" if name else f"a parameter of shape {tuple(p.shape)} (not the model's)"
        if (id(p) in mine and not sharded) or (name is None and not replicated):
            continue
        if id(p) in mine:
            why = ("data_parallel='fsdp' holds it as a shard outside the forward. What to do: compute that term in the "
                   "model's forward and return it (it is then merged as an output), or build with data_parallel='ddp'")
        elif p.is_meta:
            why = ("another rank's stage holds it (here it is on meta). What to do: compute that term in the model's "
                   "forward and return it, so the stage holding the parameter computes it")
        elif name is None:
            why = ("each data-parallel replica's last stage would train its own copy (its gradient never summed "
                   "over the replicas), or the schedule (zero bubble) computes the stages' weights' gradients alone "
                   "(it would get none). What to do: use it in the model's forward (return what loss_fn needs), or "
                   "a schedule without a weight pass of its own (gpipe, 1f1b, interleaved1f1b)")
        else:
            why = ("no stage of this pipeline uses it, so only the last stage's rank would train it: it is in no "
                   "rank's pipe.parameters(), pipe.clip_grad_norm_ would leave it out, the other ranks' "
                   "pipe.state_dict() would hold it untrained, and data-parallel replicas would never sum its "
                   "gradient. What to do: use it in the model's forward (return what loss_fn needs, e.g. logits / "
                   "self.temperature), or keep it out of the model")
        raise StepError(f"loss_fn reads {said}, which requires grad, and {why}. Nothing was sent. (A frozen network "
                        "the loss runs, a teacher or a feature extractor, needs no gradient: requires_grad_(False) "
                        "on it.)")
