"""The merge of a counted loss's micro-batch values: ``sum_i n_i L_i / sum_i n_i``.

Each micro-batch's loss is a mean over what it counts (:mod:`fxpipe.checks._counted_labels`
decides that and counts them); the merged loss weighs each by its count, exactly the whole
batch's mean in value and gradient. A micro-batch that counts nothing is ``sum / 0``: it
enters with weight 0 and no gradient at all -- unless no micro-batch counts anything: eager's
whole-batch loss is ``0 / 0`` then and still backpropagates (zeros through a cross entropy,
nan through a masked mean), so every micro-batch's backward runs (a trial: gradients None
where eager's were zeros, and AdamW's momentum and weight decay moved only eager's weights).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["counted_part", "weighted_mean"]


class _NoGradientWhenEmpty(torch.autograd.Function):
    """``part`` as it is; in backward, no gradient at all (None) when its count is 0 and the
    batch's total is not (a batch counting nothing backpropagates as eager's does).

    Why not a zero gradient: the part is ``sum / count`` inside the model (a masked mean, a
    cross entropy whose targets' class weights sum to 0), and the division's backward turns even
    a zero gradient into 0 * (1 / 0) = nan in every parameter (measured). With None autograd does
    not go into that micro-batch's loss at all, as eager's whole-batch loss gives its terms none
    (each is weighed by its mask or class weight, 0). The count is read in backward, once."""

    @staticmethod
    def forward(ctx: Any, part: Tensor, count: Tensor, total: Tensor) -> Tensor:
        ctx.save_for_backward(count, total)
        return part.view_as(part)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None, None]:
        count, total = ctx.saved_tensors
        return (None if not bool(count != 0) and bool(total != 0) else grad), None, None


def counted_part(part: Tensor, count: Tensor, total: Tensor) -> Tensor:
    """A micro-batch's loss as it enters a merge weighed by ``count`` of the batch's ``total``:
    no gradient when it counts nothing and the batch something."""
    return _NoGradientWhenEmpty.apply(part, count, total) if part.requires_grad else part


def weighted_mean(parts: Sequence[Tensor], counts: Sequence[Tensor]) -> Tensor:
    """``sum_i n_i parts_i / sum_i n_i`` in the parts' dtype (weights in float32 at least).

    A micro-batch that counts no label has the mean 0/0 = nan; it enters with weight 0
    (``torch.where``) and no gradient (:func:`counted_part`). No label counted at all gives
    nan, as the model does, and a gradient through every part, as the model's.
    """
    first = parts[0]
    dtype = torch.promote_types(first.dtype, torch.float32)
    n = torch.stack([c.to(first.device) for c in counts]).to(dtype)
    total = n.sum()
    values = torch.stack([counted_part(p, c, total).to(first.device, dtype) for p, c in zip(parts, counts)])
    values = torch.where(n > 0, values, torch.zeros_like(values))
    return ((values * n).sum() / total).to(first.dtype)
