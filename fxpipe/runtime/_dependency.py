"""Fork/Join: explicit autograd dependencies between micro-batches.

Autograd orders backward work only by data dependencies. The pipeline needs more: on each
device, micro-batch i-1's backward must run after micro-batch i's (the reverse of the
forward order), or recomputation and copies would interleave badly and memory would peak.
``fork`` taps a tensor for an empty "phony" and ``join`` attaches that phony to another
tensor, which creates the edge without moving data.

Backward visits every node these functions add, also where no gradient flows (a tensor read
only by ``argmax``): that is what orders it. Such a visit must pass the absent gradient on
as ``None``, never as zeros (autograd Functions materialize zeros by default), or a
parameter eager leaves at ``grad None`` would get a zero gradient, which optimizers treat
differently (weight decay, moments). Every function here does ``set_materialize_grads(False)``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._phony import get_phony

__all__ = ["fork", "join", "Fork", "Join", "Depend", "depend_tensors"]


def fork(input: Tensor) -> Tuple[Tensor, Tensor]:
    """Branches a phony off ``input``; backward through the phony happens after ``input``'s."""
    if torch.is_grad_enabled() and input.requires_grad:
        input, phony = Fork.apply(input)
    else:
        phony = get_phony(input.device, requires_grad=False)
    return input, phony


class Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx, grad_input: Optional[Tensor], grad_grad: Optional[Tensor]) -> Optional[Tensor]:  # type: ignore[override]
        return grad_input


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Merges ``phony`` into ``input``: backward reaches the phony's source after ``input``."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        input = Join.apply(input, phony)
    return input


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor, phony: Tensor) -> Tensor:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        return input.detach()

    @staticmethod
    def backward(ctx, grad_input: Optional[Tensor]) -> Tuple[Optional[Tensor], None]:  # type: ignore[override]
        return grad_input, None


def depend_tensors(before: Tensor, after: Tensor) -> Tuple[Tensor, Tensor]:
    """Fork from ``before`` and join into ``after`` in one autograd node.

    Backward reaches ``before``'s producer only once ``after``'s gradient is there (the
    point of Fork/Join) -- and, being one node, also holds ``after``'s gradient until
    ``before``'s has arrived. In the pipeline that extra wait is already implied by the
    reverse clock-cycle order, so the schedule is the same with half the Python autograd
    functions (each costs tens of microseconds).
    """
    if torch.is_grad_enabled() and (before.requires_grad or after.requires_grad):
        return Depend.apply(before, after)
    return before, after


class Depend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, before: Tensor, after: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        return before.detach(), after.detach()

    @staticmethod
    def backward(ctx, grad_before: Optional[Tensor], grad_after: Optional[Tensor]):  # type: ignore[override]
        return grad_before, grad_after
