"""Automatic balancing of an ``nn.Sequential`` for ``fxpipe.GPipe``.

Both functions profile each layer on a sample and then choose the *optimal* contiguous
split that minimises the largest partition cost (torchgpipe's block-partition heuristic is
not optimal). Profiling runs on copies of the layers in training mode, so the module is
left untouched.
"""

from __future__ import annotations

import copy
import time
from typing import List, Optional

import torch
from torch import Tensor, nn

from .runtime._devices import Device, default_devices
from .plan._chain_cut import split_chain
from .runtime._microbatch import Batch, TensorOrTensors
from .runtime._stream import synchronize

__all__ = ["balance_by_time", "balance_by_size", "balance_cost", "profile_times", "profile_sizes"]



def _prepare(sample: TensorOrTensors, device: torch.device) -> Batch:
    batch = Batch(sample)
    for i, x in enumerate(batch):
        batch[i] = x.detach().to(device).requires_grad_(x.requires_grad)
    return batch


def _detached(batch: Batch) -> Batch:
    out = Batch(batch.value, atomic=batch.atomic)
    for i, x in enumerate(out):
        if isinstance(x, Tensor):
            out[i] = x.detach().requires_grad_(x.requires_grad)
    return out


def _layers(module: nn.Sequential, device: torch.device) -> List[nn.Module]:
    """Copies of the layers on ``device`` in training mode, as they will be trained (and as
    torchgpipe profiles them, whatever mode the module is in); profiling never touches the
    real module."""
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned")
    return [copy.deepcopy(layer).to(device).train() for layer in module]


def balance_cost(cost: List[float], partitions: int) -> List[int]:
    """The optimal balance (layers per partition) for per-layer costs."""
    return split_chain(cost, partitions)


def profile_times(module: nn.Sequential, sample: TensorOrTensors, timeout: float, device: torch.device) -> List[float]:
    """Forward+backward seconds of each layer: the fastest of at least 3 passes, repeated
    until ``timeout`` passes (interference only adds time, so the minimum is the most
    faithful estimate)."""
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("some parameter already has gradient")
    layers = _layers(module, device)
    first = _prepare(sample, device)
    times: List[List[float]] = [[] for _ in layers]
    begun = time.perf_counter()
    while len(times[0]) < 3 or time.perf_counter() - begun < timeout:
        batch = first
        for i, layer in enumerate(layers):
            batch = _detached(batch)
            synchronize(device)
            tick = time.perf_counter()
            batch = batch.call(layer)
            outputs = [y for y in batch if isinstance(y, Tensor) and y.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, outputs)
            synchronize(device)
            times[i].append(time.perf_counter() - tick)
    return [min(t) for t in times]


def balance_by_time(
    partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
    timeout: float = 1.0, device: Optional[Device] = None,
) -> List[int]:
    """Balance by the elapsed forward+backward time of each layer on ``sample``."""
    dev = torch.device(device) if device is not None else default_devices(1)[0]
    return balance_cost(profile_times(module, sample, timeout, dev), partitions)


def _tensor_bytes(batch: Batch) -> int:
    return sum(x.numel() * x.element_size() for x in batch if isinstance(x, Tensor))


def profile_sizes(
    module: nn.Sequential, input: TensorOrTensors, chunks: int, param_scale: float, device: torch.device,
) -> List[float]:
    """Bytes each layer needs in training: its activations for one micro-batch + scaled params.

    Activation bytes are measured from the tensors the layer produces and keeps for
    backward (its outputs and the saved tensors autograd holds), so this works on CPU too.
    """
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("some parameter already has gradient")
    layers = _layers(module, device)
    batch = _prepare(input, device)
    if chunks > 1:
        # One micro-batch is what a partition holds at a time.
        parts = tuple(x.chunk(chunks)[0] for x in batch)
        first = Batch(parts[0]) if batch.atomic else Batch(parts)
    else:
        first = batch
    sizes: List[float] = []
    batch = first
    for layer in layers:
        batch = _detached(batch)
        saved: dict = {}

        def pack(t: Tensor) -> Tensor:
            saved[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = batch.call(layer)
        activation = max(_tensor_bytes(out), sum(saved.values()))
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(activation + param_scale * params)
        batch = out
    return sizes


def balance_by_size(
    partitions: int, module: nn.Sequential, input: TensorOrTensors, *,
    chunks: int = 1, param_scale: float = 2.0, device: Optional[Device] = None,
) -> List[int]:
    """Balance by the memory each layer needs: activations of a micro-batch + parameters.

    ``param_scale`` counts the copies an optimizer keeps per parameter (2 for SGD with
    gradients, 4-5 for Adam).
    """
    dev = torch.device(device) if device is not None else default_devices(1)[0]
    return balance_cost(profile_sizes(module, input, chunks, param_scale, dev), partitions)
