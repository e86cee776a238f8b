"""What both front ends share: the module a placed pipeline is, and its settings.

``fxpipe.pipeline``'s :class:`~fxpipe.api.Pipeline` and the torchgpipe-compatible
:class:`~fxpipe.gpipe.GPipe` differ in how they cut a model into stages; once cut, both are
a :class:`PlacedModule` run by the same runtime: the same lifecycle, placement rules and
``chunks`` check, the same checkpoint modes and the same choice of which micro-batches are
checkpointed. Neither front end imports the other.
"""

from __future__ import annotations

import copy
import numbers
import weakref
from types import TracebackType
from typing import Any, List, Optional, Type

import torch
from torch import nn

from ._devices import Device
from ..errors import ArgumentError, ChunksError, PlacementError
from ._batchnorm import (
    DeferredBatchNorm, convert_deferred_batch_norm, defer_batch_norms, release_deferred_batch_norm,
)
from ._pipeline import PipelineRunner

__all__ = ["PlacedModule", "CHECKPOINT_MODES", "checkpoint_stop", "check_checkpoint", "check_chunks"]


CHECKPOINT_MODES = ("always", "except_last", "never")


def check_checkpoint(checkpoint: object) -> str:
    """``checkpoint`` if it is a mode, else :class:`~fxpipe.errors.ArgumentError` (at the build,
    and when ``pipe.checkpoint`` is set later)."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ArgumentError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got "
                            f"checkpoint={checkpoint!r}; pass one of them (the default is 'except_last')",
                            argument="checkpoint")
    return str(checkpoint)


def checkpoint_stop(mode: str, num_microbatches: int, training: bool) -> int:
    """How many leading micro-batches are checkpointed (none in eval or under no_grad).
    Under ``torch.func.grad`` / ``vjp`` / ``jacrev`` a checkpointed one cannot run: their
    transforms refuse the saved-tensor hooks checkpointing recomputes by (torch's bare "don't
    yet support saved tensor hooks"); refused naming the option that runs there."""
    if not (training and torch.is_grad_enabled()):
        return 0
    stop = {"always": num_microbatches, "except_last": num_microbatches - 1, "never": 0}[mode]
    if stop and _under_func_grad():
        raise ArgumentError(
            f"this pipeline checkpoints its micro-batches (checkpoint={mode!r}) and is called under torch.func.grad "
            "(or vjp, jacrev, hessian), whose transforms cannot run checkpointed code (torch refuses the "
            "saved-tensor hooks recomputation needs). What to do: build the pipeline with checkpoint='never' for "
            "use under torch.func, or take the gradient with torch.autograd.grad / backward()",
            argument="checkpoint")
    return stop


def _under_func_grad() -> bool:
    """Whether a torch.func gradient transform (grad, vjp, jacrev) is active in this thread."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters())


def check_chunks(chunks: object) -> int:
    """``chunks`` as an int. A float with an integral value is taken as that int, as torchgpipe
    does (``GPipe(..., chunks=42.0).chunks == 42``); bools, fractions and values below 1 are
    refused."""
    given = chunks
    if isinstance(chunks, numbers.Real) and not isinstance(chunks, (bool, numbers.Integral)) \
            and float(chunks).is_integer():
        chunks = int(chunks)
    if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise ChunksError(
            "number of chunks must be positive integer (chunks is the number of micro-batches "
            f"per mini-batch), got chunks={given!r}"
        )
    return int(chunks)


def _public_name(obj: object) -> str:
    cls = type(obj)
    return f"fxpipe.{cls.__name__}" if cls.__module__.startswith("fxpipe.") else cls.__name__


def _release(runtime: PipelineRunner, deferred: List[DeferredBatchNorm]) -> None:
    """What closing or collecting a pipeline undoes; references no front end, so a
    ``weakref.finalize`` holding it does not keep the pipeline alive."""
    runtime.close(wait=False)
    release_deferred_batch_norm(deferred)


class PlacedModule(nn.Module):
    """A front end whose parts the pipeline has placed on devices, run by ``self._runtime``.

    Moving it whole is refused (it would put every stage on one device); changing its dtype
    is allowed. It owns the pipeline's lifecycle: ``close()`` (or leaving a ``with`` block,
    or garbage collection) stops the worker threads and gives the deferred BatchNorm layers
    their classes back. Copies (``copy.copy``, ``copy.deepcopy``, pickling where the front
    end allows it) leave the threads, streams and finalizer behind and make their own.
    """

    _runtime: PipelineRunner
    _deferred: List[DeferredBatchNorm]

    def _open(self, runtime: PipelineRunner, model: nn.Module, deferred_batch_norm: bool) -> None:
        """Takes ownership of ``runtime``; with ``deferred_batch_norm``, defers the BatchNorms
        of ``model`` until the pipeline is closed.

        Front ends call it last in ``__init__``, so a failing constructor leaves no
        converted layer behind. Layers already deferred by class (``fxpipe.batchnorm``)
        start a fresh mini-batch: what they tracked so far came from runs made while
        building (profiling, export), not from training.
        """
        for layer in model.modules():
            if isinstance(layer, DeferredBatchNorm):
                layer._reset_deferred()
        self._runtime = runtime
        self._deferred = convert_deferred_batch_norm(model) if deferred_batch_norm else []
        self._watch()

    def _watch(self) -> None:
        self._runtime.label = _public_name(self)
        finalizer = weakref.finalize(self, _release, self._runtime, self._deferred)
        # Like the workers' own finalizer: never run at interpreter exit (see worker.py).
        finalizer.atexit = False
        self._finalizer = finalizer

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._runtime.closed

    def close(self) -> None:
        """Stops the worker threads and restores the model's BatchNorm classes. Idempotent.

        Calling the pipeline afterwards raises :class:`PipelineClosedError`; the model
        itself is left exactly as it was before the pipeline was built.
        """
        self._runtime.close()
        self._finalizer()
        self._deferred = []

    def __enter__(self) -> "PlacedModule":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    # -- copies ------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_finalizer", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # The copied layers arrive as plain BatchNorms (see runtime/_batchnorm.py).
        self._deferred = [] if self._runtime.closed else defer_batch_norms(self._deferred)
        self._watch()

    def __copy__(self) -> "PlacedModule":
        new = type(self).__new__(type(self))
        state = self.__getstate__()
        state["_runtime"] = copy.copy(self._runtime)  # shares partitions, not threads
        new.__setstate__(state)
        return new

    def __deepcopy__(self, memo: dict) -> "PlacedModule":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    # -- settings ----------------------------------------------------------------------

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch; assignments are validated."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        self._chunks = check_chunks(value)

    # -- placement ---------------------------------------------------------------------

    def _moving_denied(self) -> PlacementError:
        return PlacementError(
            f"denied to move parameters and buffers, because {_public_name(self)} should manage "
            "device placement: its stages are placed on their devices. Pass devices=[...] when "
            "building it; changing the dtype (.to(torch.float64)) is allowed."
        )

    def cuda(self, device: Optional[Device] = None) -> "PlacedModule":  # type: ignore[override]
        raise self._moving_denied()

    def cpu(self) -> "PlacedModule":  # type: ignore[override]
        raise self._moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> "PlacedModule":  # type: ignore[override]
        # Deny to(device), to(tensor); allow to(dtype).
        if "device" in kwargs or "tensor" in kwargs:
            raise self._moving_denied()
        if args and (isinstance(args[0], (torch.device, int, str)) or torch.is_tensor(args[0])):
            raise self._moving_denied()
        return super().to(*args, **kwargs)  # type: ignore[return-value]
