"""A checkpointed stage forward recomputed once per micro-batch, whatever the schedule.

``torch.utils.checkpoint`` (non-reentrant) recomputes a checkpointed region in every autograd
call that reaches it: it keys its recomputed tensors by the graph task and hands each out once.
A zero-bubble schedule makes several such calls per micro-batch and stage: the input-gradient
pass (B), then in the weight pass (W) one ``autograd.grad`` per parameter group, and fxpipe's
completion of the weights W would miss (:mod:`._split_backward`). Measured on the U-Net under
``zbv`` with 6 chunks: a layer's forward ran 54 times per step, against 12 under gpipe.
torch's ``GraphExecGroup`` (recompute at most once per group of calls) does not fit: W runs
again the nodes at which B recorded the gradient, unpacking their saved tensors a second time,
which the group refuses.

So a checkpointed stage forward runs under fxpipe's own checkpointing
(:class:`fxpipe.runtime._checkpoint.Checkpointing`: saved-tensor hooks; RNG states, the
stage's own generators and the autocast state restored; the stage's buffers as the forward saw
them, the recomputation's updates dropped), with one change (:class:`SharedRecomputation`): the
tensors recomputed at the first unpack are kept and handed to every later backward pass of the
same graph, until the graph frees its saved tensors (after W, or after a full backward). Between
B and W they are what an uncheckpointed stage keeps anyway: zero bubble holds the graph for W.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from fxpipe.runtime._checkpoint import Checkpointing, StateSlot
from fxpipe.runtime._microbatch import Batch
from fxpipe.runtime._randomness import may_draw_random, stage_generators

__all__ = ["SharedRecomputation", "StageCheckpoint"]


class SharedRecomputation(Checkpointing):
    """:class:`Checkpointing` whose recomputation, run at the first unpacked tensor, serves
    every backward pass through the graph: the stage runs at most twice per micro-batch."""

    __slots__ = ()

    def _unpack(self, n: int) -> torch.Tensor:
        recomputed = self.recomputed
        if recomputed is None:
            recomputed = self._recompute()
        return recomputed[n]  # type: ignore[return-value]


class StageCheckpoint:
    """Runs one stage's checkpointed forwards. What a recomputation restores is found once,
    from the stage: whether it may draw random numbers, its own ``torch.Generator``s, and its
    buffers (each seen by the recomputation as the forward saw it: a snapshot swapped in, so
    a buffer the forward updates is updated once, and the live buffer's version counter is
    left alone)."""

    def __init__(self, stage: nn.Module, where: str) -> None:
        self.stage = stage
        self.where = where
        self.random = may_draw_random(stage)
        self.generators = stage_generators(stage)
        self.slots: list[StateSlot] = [(m, "_buffers", k) for m in stage.modules()
                                       for k, b in m._buffers.items() if b is not None]

    def __call__(self, *args: Any) -> Any:
        """``stage(*args)`` keeping no activations; recomputed once for all its backward passes."""
        stage = self.stage
        chk = SharedRecomputation(lambda batch: batch.call(stage, spread=True), Batch(tuple(args), atomic=False),
                                  self._device(args), random=self.random, state=self.slots, where=self.where,
                                  generators=self.generators)
        return chk.checkpoint().value

    def _device(self, args: Sequence[Any]) -> torch.device:
        """Where the stage runs (whose RNG state a recomputation restores besides the CPU's)."""
        for t in args:
            if isinstance(t, torch.Tensor):
                return t.device
        for t in (*self.stage.parameters(), *self.stage.buffers()):
            return t.device
        return torch.device("cpu")
