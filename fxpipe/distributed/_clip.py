"""Clipping by the norm of the whole model's gradient, over every rank of the pipeline.

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), 0.5)`` on each rank clips each rank's
gradients by that rank's own norm (1.26 and 1.19 where the model's is 1.58, issue #30): not the
model's training, and the two copies of a tied embedding / LM head are scaled differently and
drift apart. :func:`clip_grad_norm_` computes the norm torch would compute on the whole model:
each rank's share (the ``p``-th powers of its gradients' norms summed, or their maximum for
``inf``), one all-reduce, and every rank scales its gradients by the same factor. A tied
parameter's copies hold the same gradient after a step (:mod:`._ties`), so it is counted once,
on the lowest rank holding it, and scaled alike everywhere.

torch's own, on one process: ``total = ||(||g_1||, ..., ||g_n||)||``, ``coef = max_norm /
(total + 1e-6)`` clamped to 1, every gradient multiplied by it. The same here, with the
per-rank sums in float64 (the order of the sums differs from one process's: equal to rounding).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ._sharding import local_part

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: Iterable[nn.Parameter], counted: Callable[[nn.Parameter], bool],
                    max_norm: float, norm_type: float, group: dist.ProcessGroup, device: torch.device,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scales this rank's gradients by the factor of the global norm; returns that norm (0-dim,
    on every rank alike). ``counted(p)``: whether this rank's ``p`` counts in the norm. Every
    rank of ``group`` must call it (one all-reduce)."""
    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    mine = [p.grad for p in parameters if p.grad is not None and counted(p)]
    dtype = grads[0].dtype if grads else torch.float32
    share = torch.zeros((), dtype=torch.float64, device=device)
    for g in mine:
        n = torch.linalg.vector_norm(local_part(g.detach()), norm_type).to(device=device, dtype=torch.float64)
        if math.isinf(norm_type):
            share = torch.maximum(share, n)
        elif norm_type == 0:  # torch's order 0 over the tensors' norms: the tensors with a nonzero gradient
            share = share + (n != 0).to(torch.float64)
        else:
            share = share + n ** norm_type
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    dist.all_reduce(share, op=op, group=group)
    total = share if math.isinf(norm_type) or norm_type == 0 else share ** (1.0 / norm_type)
    total = total.to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from all ranks of the pipeline is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # in the gradients' dtype, as torch's
    for g in grads:
        local_part(g.detach()).mul_(coef.to(device=g.device, dtype=g.dtype))
    return total
