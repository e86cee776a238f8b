"""The merge of a counted loss's micro-batch values: ``sum_i n_i L_i / sum_i n_i``.

Each micro-batch's loss is a mean over what it counts (:mod:`fxpipe.checks._counted_labels`
decides that and counts them); the merged loss weighs each by its count, exactly the whole
batch's mean in value and gradient. A micro-batch that counts nothing is ``sum / 0``: it
enters with weight 0 and no gradient at all.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["counted_part", "weighted_mean"]


class _NoGradientWhenEmpty(torch.autograd.Function):
    """``part`` as it is; in backward, no gradient at all (None) when its count is 0.

    Why not a zero gradient: the part is ``sum / count`` inside the model (a masked mean, a
    cross entropy whose targets' class weights sum to 0), and the division's backward turns even
    a zero gradient into 0 * (1 / 0) = nan in every parameter (measured). With None autograd does
    not go into that micro-batch's loss at all, as eager's whole-batch loss gives its terms none
    (each is weighed by its mask or class weight, 0). The count is read in backward, once."""

    @staticmethod
    def forward(ctx: Any, part: Tensor, count: Tensor) -> Tensor:
        ctx.save_for_backward(count)
        return part.view_as(part)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None]:
        (count,) = ctx.saved_tensors
        return (None if not bool(count != 0) else grad), None


def counted_part(part: Tensor, count: Tensor) -> Tensor:
    """A micro-batch's loss as it enters a merge weighed by ``count``: no gradient when it counts nothing."""
    return _NoGradientWhenEmpty.apply(part, count) if part.requires_grad else part


def weighted_mean(parts: Sequence[Tensor], counts: Sequence[Tensor]) -> Tensor:
    """``sum_i n_i parts_i / sum_i n_i`` in the parts' dtype (weights in float32 at least).

    A micro-batch that counts no label has the mean 0/0 = nan; it enters with weight 0
    (``torch.where``) and no gradient (:func:`counted_part`). No label counted at all gives
    nan, as the model does.
    """
    first = parts[0]
    dtype = torch.promote_types(first.dtype, torch.float32)
    n = torch.stack([c.to(first.device) for c in counts]).to(dtype)
    values = torch.stack([counted_part(p, c).to(first.device, dtype) for p, c in zip(parts, counts)])
    values = torch.where(n > 0, values, torch.zeros_like(values))
    return ((values * n).sum() / n.sum()).to(first.dtype)
