"""A sample whose samples are all alike, varied for the build's micro-batch checks.

The checks compare the whole sample with its micro-batches merged. A sample of identical
rows -- ``torch.zeros``, ``torch.ones``, one example repeated, the dummy inputs people build
from -- hides every batch mixing: ``h - h.mean(0)`` is the same per micro-batch as over the
batch when every row is the same (a trial: built, then 0.20 off on real batches). When every
input split along the batch has identical slices there, :func:`varied` gives the checks a
copy whose samples differ: floating inputs get seeded noise of their own scale (1 where they
are constant), integer ones (token ids, labels) each sample's values permuted, so that every
value stays one the model was given. The capture, the plan and the profile keep the user's
sample; only the checks run on the varied one.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["varied"]


def _alike(x: Tensor, dim: int) -> bool:
    rows = x.movedim(dim, 0)
    return rows.shape[0] > 1 and bool((rows == rows[:1]).all())


def varied(flat: Sequence[Any], dims: Sequence[Optional[int]]) -> Optional[List[Any]]:
    """``flat`` with its samples made to differ (see the module), or None where they already
    differ in some input split along the batch (or none is split)."""
    split = [(i, x, d) for i, (x, d) in enumerate(zip(flat, dims))
             if isinstance(x, Tensor) and d is not None and x.dim() > d and x.numel()]
    if not split or any(x.is_meta for _, x, _ in split) or not all(_alike(x, d) for _, x, d in split):
        return None  # on meta there are no values to vary (nor does the check compare any)
    g = torch.Generator(device="cpu").manual_seed(0)
    out = list(flat)
    for i, x, d in split:
        if x.is_floating_point():
            scale = float(x.detach().double().abs().max()) or 1.0
            noise = torch.randn(x.shape, generator=g, dtype=torch.float32) * (0.5 * scale)
            out[i] = (x.detach() + noise.to(dtype=x.dtype, device=x.device)).requires_grad_(x.requires_grad)
        elif x.dim() > d + 1 and not x.is_complex() and x.dtype is not torch.bool:
            rows = x.movedim(d, 0).reshape(x.shape[d], -1)
            order = torch.stack([torch.randperm(rows.shape[1], generator=g) for _ in range(rows.shape[0])])
            permuted = torch.gather(rows, 1, order.to(rows.device))
            out[i] = permuted.reshape(x.movedim(d, 0).shape).movedim(0, d).contiguous()
    return out
