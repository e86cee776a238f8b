"""The loss after the model, timed on one micro-batch, for the last stage's actions.

Why: the stages are timed from the mean of their outputs (:mod:`._stage_timing`), and the
loss a user trains with can cost a good part of the step (a language model's cross entropy
over its vocabulary: 14-23 ms of a tiny Qwen3's step on a CPU, issue 33). With ``loss_fn``
given, ``loss_fn(output, target)`` runs on one micro-batch's output (the model called on
the first ``size`` samples, without gradients; the output detached, needing grad), its
forward and its backward down to that output timed over rounds and the fastest taken, as the
stages are. The last stage's forward and backward then include them: the
runtimes compute the loss per micro-batch where they can (``Pipeline.step``, torch's
schedules), and on GPipe's merged output once (about the same work, over the whole batch).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from ..runtime._stream import synchronize

__all__ = ["time_loss", "first_samples"]


def first_samples(value: Any, size: int) -> Any:
    """``value`` with every tensor of a batch dim cut to its first ``size`` samples (dim 0)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t[:size] if t.dim() and t.shape[0] >= size else t, value)


def time_loss(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[..., torch.Tensor],
              target: Any, rounds: int = 5, device: Optional[torch.device] = None) -> Tuple[float, float]:
    """(forward, backward) seconds of ``loss_fn(model(*args, **kwargs), target)`` past the
    model: the fastest of ``rounds`` after one warm-up (interference only adds time). The caller keeps the model's state
    (:func:`fxpipe.capture._prepare.preserved`)."""
    with torch.no_grad():
        out = model(*args, **kwargs)
    forward, backward = [], []
    for r in range(max(1, rounds) + 1):
        leaf = pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point() or t.is_complex()), out)
        synchronize(device)
        t0 = time.perf_counter()
        with torch.enable_grad():
            loss = loss_fn(leaf, target) if target is not None else loss_fn(leaf)
        synchronize(device)
        t1 = time.perf_counter()
        loss.backward()
        synchronize(device)
        t2 = time.perf_counter()
        if r > 0:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    return min(forward), min(backward)
