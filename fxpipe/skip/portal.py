"""Portals carry a skip tensor straight from its stash partition to its pop partition.

Without portals a skip tensor would be threaded through every partition in between, copied
at each hop (the paper's "sequential form", §3.3). A portal keeps the tensor aside and adds
three autograd functions around it:

* ``PortalBlue`` (stash side) returns a phony joined to the stash partition's output; its
  backward hands the skip's gradient, left by the pop side, to the stashed tensor;
* ``PortalCopy`` moves the tensor to the pop partition's device on the copy streams, once,
  and moves the gradient back in backward;
* ``PortalOrange`` (pop side) returns the tensor; its backward leaves the gradient in the
  portal for ``PortalBlue``.

"Tensor life" counts the remaining uses so the portal drops its reference as soon as the
last one happened: 2 without checkpointing (blue, orange), 3 with it (the recomputation's
orange needs the tensor once more), reset to 1 when the stash partition recomputes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..runtime.copy import move
from ..runtime.phony import get_phony
from ..runtime.stream import AbstractStream, get_device

__all__ = ["Portal"]


class Portal:
    """Holds one skip tensor of one micro-batch, and its gradient."""

    def __init__(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        self.put_tensor(tensor, tensor_life)
        self.grad: Optional[Tensor] = None

    def blue(self) -> Tensor:
        """Stash side: a phony whose backward delivers the gradient to the stashed tensor."""
        tensor = self.use_tensor()
        if tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalBlue.apply(self, tensor)

    def orange(self, after: Optional[Tensor]) -> Optional[Tensor]:
        """Pop side: the tensor, connected to autograd when gradients are being recorded.

        ``after`` is a tensor of the popping partition's input. Making PortalOrange depend
        on it orders the backward: the skip's gradient is left in the portal before the
        input's gradient -- and with it PortalCopy's backward, which moves that gradient to
        the stash device -- is computed.
        """
        self.check_tensor_life()
        if self.tensor is None or not torch.is_grad_enabled():
            return self.use_tensor()
        if after is None or not after.requires_grad:
            after = get_phony(self.tensor.device, requires_grad=True)
        return PortalOrange.apply(self, after)

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor) -> Tensor:
        """Moves the tensor to the pop partition's device; returns a phony to join."""
        if self.tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalCopy.apply(self, prev_stream, next_stream, phony)

    def check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise RuntimeError("tensor in portal has been removed")

    def put_tensor(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        self.tensor_life = tensor_life
        self.tensor = tensor if tensor_life > 0 else None

    def use_tensor(self) -> Optional[Tensor]:
        self.check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: Optional[Tensor]) -> None:
        self.grad = grad

    def use_grad(self) -> Optional[Tensor]:
        grad, self.grad = self.grad, None
        return grad


class PortalBlue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, portal: Portal, tensor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.portal = portal
        return get_phony(tensor.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx, grad_phony: Tensor) -> Tuple[None, Optional[Tensor]]:  # type: ignore[override]
        return None, ctx.portal.use_grad()


class PortalOrange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, portal: Portal, after: Tensor) -> Tensor:  # type: ignore[override]
        ctx.portal = portal
        tensor = portal.use_tensor()
        assert tensor is not None
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[None, None]:  # type: ignore[override]
        ctx.portal.put_grad(grad)
        return None, None


class PortalCopy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, portal: Portal, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor
    ) -> Tensor:
        ctx.portal = portal
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        assert portal.tensor is not None
        (portal.tensor,) = move([portal.tensor], prev_stream, next_stream)
        return get_phony(get_device(next_stream), requires_grad=False).detach()

    @staticmethod
    def backward(ctx, grad_phony: Tensor) -> Tuple[None, None, None, None]:  # type: ignore[override]
        portal = ctx.portal
        (portal.grad,) = move([portal.grad], ctx.next_stream, ctx.prev_stream)
        return None, None, None, None
