"""``fxpipe.batchnorm``: torchgpipe's ``DeferredBatchNorm``, for code written against it.

torchgpipe code converts a model by hand::

    from fxpipe.batchnorm import DeferredBatchNorm     # was: from torchgpipe.batchnorm import ...
    model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks)

Each converted layer normalises every micro-batch on its own statistics, merges the
statistics of ``chunks`` training forward calls (recomputations excluded) and commits them
to ``running_mean``/``running_var`` once, so after a mini-batch of ``chunks`` micro-batches
the running statistics equal those of the plain layer run on the whole mini-batch. Unlike
torchgpipe, the running variance is the unbiased one, as ``torch.nn.BatchNorm`` tracks it.

These are ordinary modules the user owns (they pickle as themselves and stay converted);
``deferred_batch_norm=True`` on a pipeline instead swaps classes for the pipeline's
lifetime only. A pipeline built with that option commits these layers after every
mini-batch as well, which is the same thing when the mini-batch has ``chunks`` micro-batches.
"""

from __future__ import annotations

from typing import Optional, TypeVar

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from .errors import BatchNormConversionError
from .runtime._batchnorm import DeferredBatchNorm as _Deferred

__all__ = ["DeferredBatchNorm", "BatchNormConversionError"]

TModule = TypeVar("TModule", bound=nn.Module)


class DeferredBatchNorm(_Deferred):
    """A BatchNorm that commits running statistics once every ``chunks`` micro-batches.

    It accepts the inputs of any BatchNorm (``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)``,
    ...): the layer it replaces has already fixed ``num_features``.
    """

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
        affine: bool = True, chunks: int = 1,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise BatchNormConversionError(f"chunks must be a positive integer (micro-batches per mini-batch), got chunks={chunks!r}")
        self.chunks = chunks
        self._reset_deferred()

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _track(self, input: Tensor) -> None:
        super()._track(input)
        if self._tracked == self.chunks:
            self.commit()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunks={self.chunks}"

    @classmethod
    def convert_deferred_batch_norm(cls, module: TModule, chunks: int = 1) -> TModule:
        """Replaces ``module`` (when it is a BatchNorm) and every BatchNorm inside it by a
        :class:`DeferredBatchNorm` sharing its parameters and buffers; returns the result.

        Submodules are replaced in place, so ``module`` itself is converted unless it is a
        BatchNorm; use the returned module. Layers with ``track_running_stats=False`` and
        layers already deferred for the same ``chunks`` are kept.
        """
        if isinstance(module, DeferredBatchNorm) and module.chunks == chunks:
            return module
        output: nn.Module = module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            output = cls._replacement(module, chunks)
        for name, child in module.named_children():
            output.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return output  # type: ignore[return-value]

    @classmethod
    def _replacement(cls, bn: _BatchNorm, chunks: int) -> "DeferredBatchNorm":
        if isinstance(bn, LazyModuleMixin) and bn.has_uninitialized_params():
            raise BatchNormConversionError(
                f"{type(bn).__name__} has not inferred num_features yet; run one forward "
                "(or build the model with sizes) before convert_deferred_batch_norm"
            )
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, chunks)
        if bn.affine:
            new.register_parameter("weight", bn.weight)
            new.register_parameter("bias", bn.bias)
        new.register_buffer("running_mean", bn.running_mean)
        new.register_buffer("running_var", bn.running_var)
        new.register_buffer("num_batches_tracked", bn.num_batches_tracked)
        new.train(bn.training)
        return new
