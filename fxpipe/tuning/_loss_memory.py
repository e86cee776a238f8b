"""The loss's memory after the model, measured on one micro-batch's output.

Why: a constant did not fit every loss (issue 33). The peak of ``loss_fn(output,
target).backward()`` above the output depends on the loss and the output's dtype: ``pow(2).mean()``
keeps the output (saved for its backward) and makes about three copies of it; a cross entropy
over a vocabulary keeps its ``log_softmax`` (one copy), not the logits, and its backward makes
two more.

How: the model runs one micro-batch without gradients; its output (each floating tensor a
leaf needing grad, allocated before the measurement) goes through ``loss_fn`` and
``backward()``; ``copies`` is the most bytes allocated at once above the output, over the
output's floating bytes (CPU: the allocator's records under ``torch.profiler``; CUDA:
``max_memory_allocated``). A loss that cannot be measured keeps the constant (:data:`DEFAULT`).
The output itself is counted by the caller (:mod:`._memory`), as the training loop keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

__all__ = ["LossMemory", "DEFAULT", "measure_loss_memory", "cpu_rise"]


@dataclass(frozen=True)
class LossMemory:
    """``copies``: the loss's peak over its forward and backward above the output, in copies
    of the output."""

    copies: float


#: without a measurement (no ``loss_fn``, on meta): an elementwise loss's backward over the
#: output, its gradient and one temporary (``2 * out * grad``)
DEFAULT = LossMemory(3.0)


def _leaves(value: Any) -> Any:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.is_floating_point() or t.is_complex()), value)


def cpu_rise(fn: Callable[[], None]) -> int:
    """The most bytes ``fn()`` had allocated at once on the CPU, above what existed before (the
    allocator's records under ``torch.profiler``; the tests measure peaks with it too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes())
    running = peak = 0
    for _, nbytes in records:
        running += nbytes
        peak = max(peak, running)
    return peak


def _rise_cuda(fn: Callable[[], None], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def measure_loss_memory(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[..., torch.Tensor],
                        target: Any, device: Optional[torch.device] = None) -> LossMemory:
    """The loss's :class:`LossMemory` on ``model(*args, **kwargs)`` (one micro-batch). The
    caller keeps the model's state (:func:`fxpipe.capture._prepare.preserved`)."""
    with torch.no_grad():
        out = _leaves(model(*args, **kwargs))
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
    if not nbytes:
        return DEFAULT

    def step() -> None:
        with torch.enable_grad():
            loss = loss_fn(out, target) if target is not None else loss_fn(out)
        loss.backward()

    step()  # warm-up: lazy initialisations are not the loss's
    for t in tensors:
        t.grad = None
    cuda = tensors[0].device.type == "cuda"
    rise = _rise_cuda(step, tensors[0].device) if cuda else cpu_rise(step)
    return LossMemory(copies=rise / nbytes)
