"""Deferred BatchNorm: running statistics of the mini-batch, not of each micro-batch.

A BatchNorm layer in a pipeline sees one micro-batch at a time; left alone it would update
``running_mean``/``running_var`` once per micro-batch, with micro-batch statistics. Here
each micro-batch's mean and sum of squared deviations are merged (Chan et al.'s parallel
algorithm, numerically stable) and committed once per mini-batch, so the running statistics
equal those the full-batch module would have. Normalisation itself still uses micro-batch
statistics: making it per mini-batch would serialise the micro-batches.

Conversion swaps the class of existing BatchNorm modules in place: parameters, buffers,
module identity and ``state_dict`` keys are unchanged, so the model passed in stays the
model that gets trained. The swap is borrowed, not permanent: every conversion is paired
with a :func:`release_deferred_batch_norm` (the pipeline's ``close()`` or its garbage
collection), and a layer whose last pipeline lets go gets its own class back, without the
deferred attributes. Meanwhile a swapped layer pickles and deep-copies as its own class, so
``torch.save(model)`` and ``copy.deepcopy(model)`` give the plain model.
"""

from __future__ import annotations

import copyreg
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import BatchNormConversionError
from ._checkpoint import is_recomputing

__all__ = [
    "DeferredBatchNorm", "convert_deferred_batch_norm", "defer_batch_norms",
    "release_deferred_batch_norm", "commit_deferred_batch_norm", "deferring", "DEFERRED_ATTRIBUTES",
    "refuse_deferred_in_graph",
]

#: Instance attributes a deferred layer carries on top of its BatchNorm state.
DEFERRED_ATTRIBUTES = ("_count", "_mean", "_m2", "_tracked", "_running")


class DeferredBatchNorm(_BatchNorm):
    """Mixin behaviour for a BatchNorm whose running statistics are committed per mini-batch."""

    _count: int
    _mean: Optional[Tensor]
    _m2: Optional[Tensor]
    _tracked: int  # micro-batches merged since the last commit

    def _reset_deferred(self) -> None:
        self._count = 0
        self._mean = None
        self._m2 = None
        self._tracked = 0

    def _track(self, input: Tensor) -> None:
        dims = [0] + list(range(2, input.dim()))
        with torch.no_grad():
            x = input.detach().to(torch.float64 if input.dtype == torch.float64 else torch.float32)
            n = input.numel() // input.size(1)
            mean = x.mean(dims)
            m2 = ((x - mean.view([1, -1] + [1] * (input.dim() - 2))) ** 2).sum(dims)
            self._tracked += 1
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
        recomputing = is_recomputing()
        if not recomputing and getattr(self, "_running", None) == 0:
            # a layer a pipeline borrowed, called eagerly (the model run by itself while the pipeline
            # is open): a BatchNorm as it was, updating its statistics now, not at the pipeline's commit
            return super().forward(input)
        if not recomputing:
            self._track(input)
        return F.batch_norm(
            input, running_mean=None, running_var=None, weight=self.weight, bias=self.bias,
            training=True, momentum=0.0, eps=self.eps,
        )


def _reduce_as_original(self: nn.Module, protocol: Any) -> Any:
    """Pickles (and deep-copies) a swapped layer as an instance of its original class.

    The swapped class is created at run time and cannot be found by name; and a copy of
    the model belongs to no pipeline, so it must be the plain BatchNorm anyway.
    """
    state = self.__getstate__()
    for name in DEFERRED_ATTRIBUTES:
        state.pop(name, None)
    # The standard library's reconstructor (what protocols 0-1 use): the pickle needs no fxpipe.
    return copyreg._reconstructor, (type(self)._fxpipe_original, object, None), state  # type: ignore[attr-defined]


_deferred_classes: Dict[Type[_BatchNorm], Type[_BatchNorm]] = {}
# How many live conversions hold each swapped layer; the last release restores it.
_holders: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _deferred_class(cls: Type[_BatchNorm]) -> Type[_BatchNorm]:
    deferred = _deferred_classes.get(cls)
    if deferred is None:
        deferred = type(f"Deferred{cls.__name__}", (DeferredBatchNorm, cls), {
            "__module__": __name__, "_fxpipe_original": cls, "__reduce_ex__": _reduce_as_original,
        })
        _deferred_classes[cls] = deferred
    return deferred


def _is_swapped(module: nn.Module) -> bool:
    return "_fxpipe_original" in vars(type(module))


def defer_batch_norms(modules: Iterable[nn.Module]) -> List[DeferredBatchNorm]:
    """Makes each tracking BatchNorm of ``modules`` deferred, in place; returns them.

    Layers that already are a :class:`DeferredBatchNorm` by class (``fxpipe.batchnorm``)
    are returned as they are and never restored. Each call must be paired with one
    :func:`release_deferred_batch_norm` of the returned list.
    """
    converted: List[DeferredBatchNorm] = []
    with _lock:
        for child in modules:
            if not (isinstance(child, _BatchNorm) and child.track_running_stats):
                continue
            if _is_swapped(child):
                _holders[child] = _holders.get(child, 0) + 1
            elif not isinstance(child, DeferredBatchNorm):
                child.__class__ = _deferred_class(type(child))
                child._reset_deferred()  # type: ignore[attr-defined]
                child._running = 0  # type: ignore[attr-defined]  # pipeline runs under way (deferring)
                _holders[child] = 1
            converted.append(child)  # type: ignore[arg-type]
    return converted


def convert_deferred_batch_norm(module: nn.Module) -> List[DeferredBatchNorm]:
    """Turns every BatchNorm in ``module`` into a deferred one, in place; returns them."""
    return defer_batch_norms(module.modules())


def release_deferred_batch_norm(modules: List[DeferredBatchNorm]) -> None:
    """Undoes one conversion: a layer no conversion holds any more gets its class back."""
    with _lock:
        for child in modules:
            count = _holders.get(child, 0)
            if count > 1:
                _holders[child] = count - 1
                continue
            _holders.pop(child, None)
            if _is_swapped(child):
                child.__class__ = type(child)._fxpipe_original  # type: ignore[attr-defined]
                for name in DEFERRED_ATTRIBUTES:
                    child.__dict__.pop(name, None)


@contextmanager
def deferring(modules: List[DeferredBatchNorm]) -> Iterator[None]:
    """While a pipeline runs its micro-batches: ``modules`` (layers it borrowed) track their
    statistics for its commit, from nothing (a step that raised left its micro-batches'
    statistics behind, pooled into the next commit). Outside, a borrowed layer is the
    BatchNorm it was (the model called eagerly updates its running statistics at once, as
    without a pipeline), while the recomputation of a checkpointed stage, in backward, tracks
    nothing either way."""
    borrowed = [bn for bn in modules if getattr(bn, "_running", None) is not None]
    for bn in modules:  # a run starts a mini-batch: what a failed run tracked is not committed with it
        bn._reset_deferred()
    for bn in borrowed:
        bn._running += 1
    try:
        yield
    finally:
        for bn in borrowed:
            bn._running -= 1


def commit_deferred_batch_norm(modules: List[DeferredBatchNorm], micro_batches: int,
                               root: Optional[nn.Module] = None) -> None:
    """Commits each layer's statistics of the mini-batch just run in ``micro_batches``; a layer
    that tracked more calls than that ran more than once per micro-batch (inside an opaque
    module, where :func:`_refuse_repeated` cannot see it): refused, nothing committed (the next
    run starts its layers from nothing, :func:`deferring`)."""
    for bn in modules:
        if bn._tracked > micro_batches:
            names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
            raise _repeated_error(names.get(id(bn), type(bn).__name__),
                                  f"{bn._tracked} calls over {micro_batches} micro-batches; no statistics of this "
                                  "call were committed")
    for bn in modules:
        bn.commit()


def refuse_deferred_in_graph(graph: torch.fx.GraphModule, method: str, chunks: int) -> None:
    """``deferred_batch_norm=True`` swaps the BatchNorm modules' classes; a torch.export graph
    calls aten's batch norm itself, which the swap never reaches: in training its running
    statistics would be updated once per micro-batch, silently. Refused, as is a layer the
    graph calls more than once (:func:`_refuse_repeated`)."""
    if chunks < 2:
        return
    if method != "export":
        _refuse_repeated(graph)
        return
    if any(_trains_batch_norm(n) for n in graph.graph.nodes):
        raise BatchNormConversionError(
            "deferred_batch_norm=True, but the model was captured with torch.export, whose graph calls aten's "
            "batch norm in training mode itself rather than the BatchNorm modules: running statistics would be "
            "updated once per micro-batch, not once per mini-batch. What to do: make the model traceable by "
            "torch.fx (keep the code torch.fx cannot trace opaque with leaf_modules=[...]), or build with "
            "chunks=1, or with the BatchNorm layers in eval mode (frozen statistics).")


def _refuse_repeated(graph: torch.fx.GraphModule) -> None:
    """A BatchNorm layer called more than once per forward (a weight-shared block applied N
    times, two views through one encoder): eager updates its running statistics once per call,
    each with that call's batch; deferred, the calls' statistics would be pooled into one update
    per mini-batch (0.15-0.25 off, a trial). Refused at the build, naming the layer."""
    calls: Dict[str, int] = {}
    for node in graph.graph.nodes:
        if node.op == "call_module":
            module = graph.get_submodule(node.target)  # in eval mode (frozen) it updates nothing; switched
            # to training later, the first commit counts its calls (commit_deferred_batch_norm)
            if isinstance(module, _BatchNorm) and module.track_running_stats and module.training:
                calls[node.target] = calls.get(node.target, 0) + 1
    for name, count in calls.items():
        if count > 1:
            raise _repeated_error(name, f"the graph calls it {count} times per forward")


def _repeated_error(name: str, how: str) -> BatchNormConversionError:
    return BatchNormConversionError(
        f"deferred_batch_norm=True, but BatchNorm layer '{name}' runs more than once per forward ({how}): "
        "the model updates its running statistics once per call, each with that call's batch, and deferred "
        "statistics would pool the calls into one update per mini-batch. What to do: build without "
        "deferred_batch_norm (each micro-batch updates the statistics), give each call a BatchNorm layer of its "
        "own, or keep the layers in eval mode (frozen statistics).")


def _trains_batch_norm(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or "batch_norm" not in str(node.target) or "no_training" in str(node.target):
        return False
    if node.target is torch.ops.aten.batch_norm.default:  # (input, weight, bias, mean, var, training, ...)
        return len(node.args) > 5 and bool(node.args[5])
    return True
