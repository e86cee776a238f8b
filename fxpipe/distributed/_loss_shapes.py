"""What data-parallel replicas must share for their losses to weigh as eager's global batch:
the proportions of a loss's counts, and samples alike where a loss is weighed by samples.

Each micro-batch's loss is weighed by its share of the global batch's first count; a loss adding
means over several counts (a token mean plus a z-loss) gets every further mean right only where
each replica counts them in one proportion (:func:`refuse_unshared_ratios`).

A step's loss is weighed by each micro-batch's count (:mod:`._loss`): what its code divides by
where fxpipe reads it (counted labels, a mask's sum), else its number of samples, for a mean
over every position (``.mean()``, ``F.mse_loss``) whose count is samples times the positions
per sample. Within one replica every micro-batch has the same positions per sample; replicas
may not (a batch padded to its own longest sequence, a smaller image). Weighed by samples
there, a mean over positions got the rows-weighted mean of the replicas' means, not eager's on
the global batch (a trial: 259.61 against 255.08, a documented refusal of a mix of counts
skipped). So such a replica's last rank reports the shapes its count stands for, in the step's
agreement (:class:`._failures.Agreement`), and replicas that differ are refused on every rank
before anything is sent.
"""

from __future__ import annotations

import math
from typing import Any, List, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx

from fxpipe.checks._loss_values import ancestors
from fxpipe.errors import StepError

__all__ = ["shape_key", "loss_fn_key", "own_loss_key", "loss_only_inputs", "refuse_unshared_ratios",
           "refuse_unshared_shapes"]


def shape_key(*values: Any) -> int:
    """A positive number (below 2**40) naming the shapes beyond the batch dim of every tensor
    in ``values``, the same on every rank for the same shapes (a hash of integers: not
    randomised per process)."""
    shapes = tuple(tuple(t.shape[1:]) if t.dim() else () for t in pytree.tree_leaves(values)
                   if isinstance(t, torch.Tensor))
    return hash(shapes) % (1 << 40) + 1


def _batched(values: Any) -> List[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor) and t.dim() > 0]


def loss_fn_key(outputs: Any, targets: Any) -> int:
    """What a ``loss_fn`` weighed by samples is a mean over, as shapes: its targets' (the values
    it is compared with: a target per position for a token mean, per sample for a sequence's
    score, whatever the outputs' length), else the outputs' (a loss of the output alone). A
    regression on a pooled score from sequences of another length per replica is a mean over
    samples (a regression trial: refused while eager's on the global batch)."""
    return shape_key(_batched(targets) or _batched(outputs))


def own_loss_key(inputs: Any, outputs: Any, targets: Any = ()) -> int:
    """The same for the model's own loss: its outputs other than the loss (the logits a mean
    over positions is taken of; a classifier's scores for a mean over samples) and the inputs
    only the loss reads (its labels: :func:`loss_only_inputs`), else, where it returns the loss
    alone, all its inputs (refused where they differ: on the safe side)."""
    batched = _batched(outputs)
    return shape_key(batched + _batched(targets)) if batched else shape_key(_batched(inputs))


def loss_only_inputs(graph: fx.Graph, loss: int) -> List[int]:
    """The flat inputs of ``graph`` that its output ``loss`` is computed from and no other
    output is: the labels of a model's own loss, whose shape says what its mean is over."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    if not 0 <= loss < len(returned) or not isinstance(returned[loss], fx.Node):
        return []
    others: set = set()
    for i, node in enumerate(returned):
        if i != loss and isinstance(node, fx.Node):
            others |= ancestors(node)
    mine = ancestors(returned[loss])
    return [k for k, p in enumerate(placeholders) if p in mine and p not in others]


def refuse_unshared_shapes(keys: Sequence[int]) -> None:
    """``keys``: per rank of the pipeline's group, its :func:`shape_key` (0: not reported).
    Every reported one must be the same; refused on every rank alike otherwise."""
    reported: List[tuple] = [(rank, key) for rank, key in enumerate(keys) if key]
    for rank, key in reported[1:]:
        if key != reported[0][1]:
            raise StepError(
                "the loss is weighed by each micro-batch's number of samples, as fxpipe reads no count in its code (a "
                "mean over every position: .mean(), F.mse_loss), and the data-parallel replicas' batches have other "
                f"shapes beyond the batch dim (ranks {reported[0][0]} and {rank}): their samples hold other numbers "
                "of positions, so weighing by samples would give the replicas' means another mean than eager's on "
                "the global batch. Nothing was sent. Give every replica batches of one shape (padded to one "
                "length), divide by a count the loss computes (a mask's sum, labels that are not ignore_index), or "
                "return a sum and divide after the step")


def refuse_unshared_ratios(reported: torch.Tensor) -> None:
    """The replicas' last ranks (a row each of ``reported``: 1 + how many ratios, then the
    ratios' bits) must report the same ratios of a loss's further counts to its first: each
    micro-batch's loss is weighed by its share of the global batch's first count, which gives
    every further mean its global value only where its count is in the same proportion on every
    replica (within one replica's micro-batches it is checked when the loss is read). Refused on
    every rank alike, before anything is sent."""
    rows = [(r, row[1:int(row[0])].contiguous().view(torch.float64).tolist()) for r, row in enumerate(reported)
            if int(row[0]) > 0]
    for r, ratios in rows[1:]:
        first, mine = rows[0]
        if len(ratios) != len(mine) or not all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(mine, ratios)):
            raise StepError(
                "loss_fn adds means over different counts (a token mean and a mean over every position, say), and "
                f"the data-parallel replicas count them in other proportions: rank {first}'s further counts are "
                f"{[round(x, 6) for x in mine]} of its first, rank {r}'s {[round(x, 6) for x in ratios]}. Each "
                "micro-batch's loss is weighed by its share of the global batch's first count, which would give the "
                "other means another value than eager's on the global batch. Nothing was sent. Divide every term by "
                "one count (the same mask's sum), return sums and divide after the step, or give each replica "
                "batches padded alike")
