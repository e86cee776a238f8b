"""Copy and Wait: moving micro-batches between devices on copy streams.

On CUDA a copy runs on a dedicated stream per (device, micro-batch) so it overlaps the
computation of other micro-batches; ``Wait`` makes the consuming stream wait for it, in
forward and, mirrored, in backward. ``record_stream`` keeps the caching allocator from
reusing memory a copy still reads or writes. Between CPU "devices" there is nothing to
copy, and ``copy``/``wait`` return the batch untouched without autograd overhead.

Absent gradients (a tensor read only by ``argmax``) stay ``None`` through both, as they do
in eager: ``set_materialize_grads(False)``, see :mod:`fxpipe.runtime._dependency`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from ._microbatch import Batch
from ._stream import AbstractStream, current_stream, get_device, is_cuda, record_stream, use_stream, wait_stream

__all__ = ["Copy", "Wait", "copy", "wait", "move"]


def move(
    tensors: Sequence[Optional[Tensor]], from_stream: AbstractStream, to_stream: AbstractStream
) -> List[Optional[Tensor]]:
    """Copies tensors to ``to_stream``'s device on the copy streams, with allocator bookkeeping.

    ``None`` entries (absent gradients) stay ``None``.
    """
    device = get_device(to_stream)
    result_stream = current_stream(device)
    moved: List[Optional[Tensor]] = []
    with use_stream(from_stream), use_stream(to_stream):
        for x in tensors:
            if x is None:
                moved.append(None)
                continue
            y = x.to(device, non_blocking=True)
            moved.append(y)
            # x is read on from_stream, which need not be the stream it was allocated on.
            record_stream(x, from_stream)
            # y was allocated on to_stream and will be used on the device's current stream.
            record_stream(y, result_stream)
    return moved


class Copy(torch.autograd.Function):
    """Copies tensors to ``next_stream``'s device; gradients go back the same way."""

    @staticmethod
    def forward(ctx, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor):  # type: ignore[override]
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        ctx.set_materialize_grads(False)
        output = move(input, prev_stream, next_stream)
        ctx.mark_non_differentiable(*[y for y in output if not (y.is_floating_point() or y.is_complex())])
        return tuple(output)

    @staticmethod
    def backward(ctx, *grad_output: Optional[Tensor]):  # type: ignore[override]
        prev_stream = ctx.prev_stream
        next_stream = ctx.next_stream
        grad_input = move(grad_output, next_stream, prev_stream)
        return (None, None) + tuple(grad_input)


class Wait(torch.autograd.Function):
    """Makes ``next_stream`` wait for ``prev_stream`` (and the reverse in backward)."""

    @staticmethod
    def forward(ctx, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor):  # type: ignore[override]
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        ctx.set_materialize_grads(False)
        wait_stream(next_stream, prev_stream)
        output = tuple(x.detach() for x in input)
        ctx.mark_non_differentiable(*[y for y in output if not (y.is_floating_point() or y.is_complex())])
        return output

    @staticmethod
    def backward(ctx, *grad_input: Optional[Tensor]):  # type: ignore[override]
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None) + grad_input


def _apply(function: type, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    tensors = batch.tensors()
    if not tensors:
        return
    outputs = function.apply(prev_stream, next_stream, *tensors)
    # A tensor that needed no grad must not start needing one after the copy.
    batch.set_tensors([y if x.requires_grad else y.detach() for x, y in zip(tensors, outputs)])


def _needs_work(prev_stream: AbstractStream, next_stream: AbstractStream, batch: Batch) -> bool:
    if is_cuda(prev_stream) or is_cuda(next_stream):
        return True
    # CPU to CPU: only tensors living elsewhere need moving.
    return any(t.device.type != "cpu" for t in batch.tensors())


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Moves ``batch``'s tensors to ``next_stream``'s device, in place."""
    if _needs_work(prev_stream, next_stream, batch):
        _apply(Copy, batch, prev_stream, next_stream)


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Orders ``next_stream`` after ``prev_stream`` for ``batch``, in place."""
    if is_cuda(prev_stream) or is_cuda(next_stream):
        _apply(Wait, batch, prev_stream, next_stream)


