"""Portals carry a skip value straight from its stash partition to its pop partition.

Without portals a skip tensor would be threaded through every partition in between, copied
at each hop (the paper's "sequential form", §3.3). A portal keeps the tensor aside and adds
three autograd functions around it:

* ``PortalBlue`` (stash side) returns a phony joined to the stash partition's output; its
  backward hands the skip's gradient, left by the pop side, to the stashed tensor;
* ``PortalCopy`` moves the tensor to the pop partition's device on the copy streams, once,
  and moves the gradient back in backward;
* ``PortalOrange`` (pop side) returns the tensor; its backward leaves the gradient in the
  portal for ``PortalBlue``.

A leaf that needed no gradient where it was stashed (the model's input image carried to the
head, a value computed from buffers alone) comes out of ``PortalOrange`` needing none either,
as eager hands it to the pop side: otherwise autograd would compute its gradient, throw it
away, and keep a ``cat``'s whole gradient alive until the stash stage's backward.

"Tensor life" counts the remaining uses so the portal drops its reference as soon as the
last one happened: 2 without checkpointing (blue, orange), 3 with it (the recomputation's
orange needs the tensor once more; given up when that partition saved nothing for backward,
so is never recomputed), reset to 1 when the stash partition recomputes. The
recomputation of a pop partition also leaves the value with the recomputed task (see
``Checkpointing.keep``), which lives as long as that partition's graph: a second backward
through a retained graph recomputes from it again, and a freed graph frees it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..tree import TreeSpec, flatten, unflatten
from ._checkpoint import checkpointing_task, recomputing_task
from ._copy import move
from ._phony import get_phony
from ._stream import AbstractStream, get_device

__all__ = ["Portal"]


class Portal:
    """Holds one skip value of one micro-batch, and its gradient.

    The value is a tensor or any structure of them (a ``split`` result, a ``ModelOutput``,
    a dataclass): its tensor leaves, found by :mod:`fxpipe.tree`, travel and get their
    gradients together, so no leaf is left behind without a gradient path.
    """

    def __init__(self, tensor: Any, tensor_life: int) -> None:
        self.stash(tensor, tensor_life)
        self.grad: Optional[Tuple[Optional[Tensor], ...]] = None

    def stash(self, value: Any, tensor_life: int) -> None:
        """Keeps a value the stash side computed (its first forward, or its recomputation),
        and which of its tensor leaves needed a gradient there, for ``PortalOrange``."""
        self.needs_grad = tuple(x.requires_grad for x in _split(value)[0])
        self.put_tensor(value, tensor_life)

    def blue(self, value: Any) -> Tensor:
        """Stash side: a phony whose backward delivers the gradients to the stashed tensors.

        ``value`` is the stashed value as computed, with its autograd history, which only
        this phony links to: the portal itself keeps the value detached (see ``put_tensor``)."""
        self.use_tensor()
        tensors, _, _ = _split(value)
        if not tensors:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalBlue.apply(self, *tensors)

    def orange(self, after: Optional[Tensor]) -> Any:
        """Pop side: the value, connected to autograd when gradients are being recorded.

        ``after`` is a tensor of the popping partition's input. Making PortalOrange depend
        on it orders the backward: the skip's gradient is left in the portal before the
        input's gradient -- and with it PortalCopy's backward, which moves that gradient to
        the stash device -- is computed.
        """
        task = recomputing_task()
        if task is not None:
            # The recomputation of a checkpointed pop stage: the first one finds the value
            # here, later ones (a second backward through a retained graph) in the task.
            value = task.keep(self, self.tensor if self.tensor_life > 0 else None)
            if self.tensor_life <= 0 and value is not None:
                self.put_tensor(value, 1)
        else:
            first_pass = checkpointing_task()
            if first_pass is not None:  # a use is kept for its recomputation, if it has one
                first_pass.popped(self)
        self.check_tensor_life()
        tensors, leaves, spec = _split(self.tensor)
        if not tensors or not torch.is_grad_enabled():
            return self.use_tensor()
        if after is None or not after.requires_grad:
            after = get_phony(tensors[0].device, requires_grad=True)
        return _join(PortalOrange.apply(self, after), leaves, spec)

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor) -> Tensor:
        """Moves the tensors to the pop partition's device; returns a phony to join."""
        if not _split(self.tensor)[0]:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalCopy.apply(self, prev_stream, next_stream, phony)

    def check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise RuntimeError("tensor in portal has been removed")

    def skip_recomputation(self) -> None:
        """The checkpointed pop partition saved nothing for backward, so it is never recomputed:
        the use kept for its recomputation's ``orange`` is given up, freeing the tensor."""
        if self.tensor_life > 0:
            self.use_tensor()

    def put_tensor(self, tensor: Any, tensor_life: int) -> None:
        """Keeps ``tensor`` (a value) for ``tensor_life`` uses, detached from autograd.

        The value's graph reaches the portal through ``PortalBlue`` alone. Keeping it
        attached would also make a reference cycle when the stash stage is checkpointed --
        portal, value, the stage's graph, its saved-tensor hooks, the checkpointed task,
        the skip tracker, portal -- which the garbage collector cannot see through autograd's
        C++ nodes: a forward without backward would leak its skips."""
        self.tensor_life = tensor_life
        self.tensor = _detach(tensor) if tensor_life > 0 else None

    def use_tensor(self) -> Any:
        self.check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: Tuple[Optional[Tensor], ...]) -> None:
        self.grad = grad

    def use_grad(self) -> Tuple[Optional[Tensor], ...]:
        grad, self.grad = self.grad, None
        return grad if grad is not None else ()


def _split(value: Any) -> Tuple[List[Tensor], List[Any], Optional[TreeSpec]]:
    """The tensor leaves of a portal's value, all its leaves, and the spec (None: a tensor)."""
    if value is None:
        return [], [], None
    if isinstance(value, Tensor):
        return [value], [value], None
    leaves, spec = flatten(value)
    return [x for x in leaves if isinstance(x, Tensor)], leaves, spec


def _detach(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    tensors, leaves, spec = _split(value)
    if not tensors:
        return value
    return _join([x.detach() for x in tensors], leaves, spec)


def _join(tensors: Sequence[Tensor], leaves: List[Any], spec: Optional[TreeSpec]) -> Any:
    """``value`` with its tensor leaves replaced by ``tensors``, in order."""
    if spec is None:
        return tensors[0]
    it = iter(tensors)
    return unflatten([next(it) if isinstance(x, Tensor) else x for x in leaves], spec)


def _differentiable(x: Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


class PortalBlue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, portal: Portal, *tensors: Tensor) -> Tensor:  # type: ignore[override]
        ctx.portal = portal
        ctx.count = len(tensors)
        ctx.set_materialize_grads(False)  # the phony's gradient is never read: no zeros to make
        return get_phony(tensors[0].device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx, grad_phony: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        grads = tuple(ctx.portal.use_grad())
        grads += (None,) * (ctx.count - len(grads))
        return (None, *grads)


class PortalOrange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, portal: Portal, after: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        ctx.portal = portal
        tensors, _, _ = _split(portal.use_tensor())
        assert tensors
        outputs = tuple(x.detach() for x in tensors)
        # What needed no gradient at the stash needs none here (as in eager).
        needs_grad = portal.needs_grad
        ctx.mark_non_differentiable(*[y for k, y in enumerate(outputs)
                                      if not (_differentiable(y) and needs_grad[k])])
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]) -> Tuple[None, None]:  # type: ignore[override]
        ctx.portal.put_grad(grads)
        return None, None


class PortalCopy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, portal: Portal, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor
    ) -> Tensor:
        ctx.portal = portal
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        ctx.set_materialize_grads(False)
        tensors, leaves, spec = _split(portal.tensor)
        assert tensors
        portal.tensor = _join(move(tensors, prev_stream, next_stream), leaves, spec)  # type: ignore[arg-type]
        return get_phony(get_device(next_stream), requires_grad=False).detach()

    @staticmethod
    def backward(ctx, grad_phony: Optional[Tensor]) -> Tuple[None, None, None, None]:  # type: ignore[override]
        portal = ctx.portal
        portal.grad = tuple(move(list(portal.grad or ()), ctx.next_stream, ctx.prev_stream))
        return None, None, None, None
