"""Deferred BatchNorm: running statistics of the mini-batch, not of each micro-batch.

A BatchNorm layer in a pipeline sees one micro-batch at a time; left alone it would update
``running_mean``/``running_var`` once per micro-batch, with micro-batch statistics. Here
each micro-batch's mean and sum of squared deviations are merged (Chan et al.'s parallel
algorithm, numerically stable) and committed once per mini-batch, so the running statistics
equal those the full-batch module would have. Normalisation itself still uses micro-batch
statistics: making it per mini-batch would serialise the micro-batches.

Conversion swaps the class of existing BatchNorm modules in place: parameters, buffers,
module identity and ``state_dict`` keys are unchanged, so the model passed in stays the
model that gets trained.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm", "commit_deferred_batch_norm"]


class DeferredBatchNorm(_BatchNorm):
    """Mixin behaviour for a BatchNorm whose running statistics are committed per mini-batch."""

    _count: int
    _mean: Optional[Tensor]
    _m2: Optional[Tensor]

    def _reset_deferred(self) -> None:
        self._count = 0
        self._mean = None
        self._m2 = None

    def _track(self, input: Tensor) -> None:
        dims = [0] + list(range(2, input.dim()))
        with torch.no_grad():
            x = input.detach().to(torch.float64 if input.dtype == torch.float64 else torch.float32)
            n = input.numel() // input.size(1)
            mean = x.mean(dims)
            m2 = ((x - mean.view([1, -1] + [1] * (input.dim() - 2))) ** 2).sum(dims)
            if self._mean is None:
                self._count, self._mean, self._m2 = n, mean, m2
                return
            total = self._count + n
            delta = mean - self._mean
            self._mean = self._mean + delta * (n / total)
            self._m2 = self._m2 + m2 + delta**2 * (self._count * n / total)
            self._count = total

    def commit(self) -> None:
        """Folds the accumulated mini-batch statistics into the running estimates."""
        if self._mean is None or self.running_mean is None or self.running_var is None:
            return
        assert self._m2 is not None
        self.num_batches_tracked += 1
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            factor = self.momentum
        # BatchNorm tracks the unbiased variance.
        var = self._m2 / max(self._count - 1, 1)
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(self._mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)
        self._reset_deferred()

    def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]
        self._check_input_dim(input)
        if not self.training or not self.track_running_stats:
            return super().forward(input)
        if not is_recomputing():
            self._track(input)
        return F.batch_norm(
            input, running_mean=None, running_var=None, weight=self.weight, bias=self.bias,
            training=True, momentum=0.0, eps=self.eps,
        )


_deferred_classes: Dict[Type[_BatchNorm], Type[_BatchNorm]] = {}


def _deferred_class(cls: Type[_BatchNorm]) -> Type[_BatchNorm]:
    if issubclass(cls, DeferredBatchNorm):
        return cls
    deferred = _deferred_classes.get(cls)
    if deferred is None:
        deferred = type(f"Deferred{cls.__name__}", (DeferredBatchNorm, cls), {"__module__": __name__})
        _deferred_classes[cls] = deferred
    return deferred


def convert_deferred_batch_norm(module: nn.Module) -> List[DeferredBatchNorm]:
    """Turns every BatchNorm in ``module`` into a deferred one, in place; returns them."""
    converted: List[DeferredBatchNorm] = []
    for child in module.modules():
        if isinstance(child, _BatchNorm) and child.track_running_stats:
            if not isinstance(child, DeferredBatchNorm):
                child.__class__ = _deferred_class(type(child))
                child._reset_deferred()  # type: ignore[attr-defined]
            converted.append(child)  # type: ignore[arg-type]
    return converted


def commit_deferred_batch_norm(modules: List[DeferredBatchNorm]) -> None:
    for bn in modules:
        bn.commit()
