"""One pipeline, any batch shape: torch's stages and schedules made per micro-batch shape, cached.

A torch.distributed.pipelining ``PipelineStage`` is made for one shape: the static metadata of
its inputs and outputs (:mod:`._meta`) sizes the receive buffers it allocates at its first step.
fxpipe's stage code takes any shape its capture allows (a torch.export capture keeps the sizes
symbolic where the model's code does, :mod:`fxpipe.capture._shape_guards`), so only that torch
layer is per shape: for each micro-batch shape a call brings (a new sequence length, a smaller
last batch), this rank makes it anew from the same stage modules -- the metadata evaluated from
one symbolic fake run of the stages (:mod:`._symbolic_meta`), new ``PipelineStage`` objects
and schedules, nothing captured, checked or planned again -- and keeps the :data:`LIMIT` most
recently used. Memory stays bounded by that:
each kept shape holds its stages' receive buffers (``chunks`` micro-batches of each boundary
value), allocated by torch at the shape's first step and freed with it.

The ranks agree on the batch before anything is sent (the batch's fingerprint, which counts its
elements, :mod:`._failures`), so every rank runs the same shape's schedule, and a rank given
another length is refused on every rank, never left waiting.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

import torch

from fxpipe.errors import BatchShapeError

__all__ = ["LIMIT", "ShapeRuns", "TrainRun", "micro_batch", "shape_key", "receive_buffer_bytes"]

#: micro-batch shapes whose stages and schedules each rank keeps (the least recently used dropped)
LIMIT = 8

Run = TypeVar("Run")


@dataclass
class TrainRun:
    """What ``step`` and ``eval_step`` run for one micro-batch shape on this rank: the training
    schedule, the forward-only one, the last stage's runner where this rank holds it, and the
    last stage's outputs of one micro-batch (meta tensors, for reading ``loss_fn``)."""

    schedule: Any
    forward_only: Any
    output: Any
    outputs: tuple[Any, ...]
    #: this rank's torch PipelineStages for the shape (their receive buffers: :func:`receive_buffer_bytes`)
    stages: list[Any]


def micro_batch(flat: Sequence[Any], chunks: int, what: str = "the batch") -> list[Any]:
    """``flat``'s tensors cut to one micro-batch along dim 0 (torch's schedules split there);
    :class:`BatchShapeError` unless every tensor has one batch size that ``chunks`` divides."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    sizes = {x.shape[0] if x.dim() else None for x in tensors}
    shapes = [tuple(x.shape) for x in tensors]
    if None in sizes:  # a count given as a tensor (the HF Trainer's num_items_in_batch): not a batch-size matter
        raise BatchShapeError(
            f"{what}'s tensor inputs have shapes {shapes}, one of them 0-dim (a count such as transformers' "
            "num_items_in_batch?): torch's schedules split every tensor input along dim 0 into micro-batches, and a "
            "0-dim tensor has no dim 0. What to do: leave it out (a labels= loss is weighed by each micro-batch's "
            "counted labels: the step's loss is the mean over the whole batch's; to accumulate several steps, scale "
            "the gradients by each step's share of the labels), or use it outside the pipeline")
    if len(sizes) != 1 or next(iter(sizes)) % chunks:
        raise BatchShapeError(
            f"every tensor input must have the same batch size along dim 0, a multiple of chunks={chunks} (torch's "
            f"schedules run micro-batches of one size, which also keeps a mean loss exact); {what}'s tensor inputs "
            f"have shapes {shapes}. A last batch of another size: make it a multiple of {chunks} (drop_last=True, or "
            "a batch sampler that keeps whole micro-batches); any length and any such batch size run on one pipeline")
    size = next(iter(sizes)) // chunks
    return [x[:size] if isinstance(x, torch.Tensor) else x for x in flat]


def shape_key(micro_flat: Sequence[Any]) -> tuple[Any, ...]:
    """What a ``PipelineStage``'s metadata depends on: each input tensor's shape and dtype."""
    return tuple((tuple(x.shape), x.dtype) for x in micro_flat if isinstance(x, torch.Tensor))


class ShapeRuns(Generic[Run]):
    """``make(micro_flat)``'s result per micro-batch shape, the :data:`LIMIT` latest kept."""

    def __init__(self, make: Callable[[Sequence[Any]], Run], limit: int = LIMIT) -> None:
        self._make = make
        self._limit = limit
        self._runs: "OrderedDict[tuple[Any, ...], Run]" = OrderedDict()
        #: runs made so far (a shape made again after it was dropped counts again)
        self.made = 0

    def get(self, micro_flat: Sequence[Any]) -> Run:
        key = shape_key(micro_flat)
        run: Optional[Run] = self._runs.pop(key, None)
        if run is None:
            # made as for training, whatever the call's mode: a run made inside inference_mode or
            # no_grad (an eval_step at a new length) served the next step() of that shape without
            # gradients ("Failed to run stage backward", a trial)
            with torch.inference_mode(False), torch.enable_grad():
                run = self._make(micro_flat)
            self.made += 1
        self._runs[key] = run  # the latest last
        while len(self._runs) > self._limit:
            self._runs.popitem(last=False)
        return run

    @property
    def latest(self) -> Optional[Run]:
        """The run used last (None before any)."""
        return next(reversed(self._runs.values()), None)

    def __len__(self) -> int:
        return len(self._runs)

    def clear(self) -> None:
        self._runs.clear()


def receive_buffer_bytes(stages: Sequence[Any]) -> int:
    """The bytes of the receive buffers torch's ``PipelineStage``\\ s hold (activations and
    gradients, every micro-batch; allocated at a shape's first step): what one cached shape
    costs."""
    seen: set[int] = set()
    total = 0
    for stage in stages:
        for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
            for infos in table.values():
                for info in infos if isinstance(infos, (tuple, list)) else (infos,):
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor) and id(buffer) not in seen:
                        seen.add(id(buffer))
                        total += buffer.numel() * buffer.element_size()
    return total
