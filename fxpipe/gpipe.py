"""``fxpipe.GPipe``: the torchgpipe-compatible front end for ``nn.Sequential``.

It splits the sequential module by ``balance``, places each partition on its device, and
runs micro-batches through the shared runtime. Behaviour, attributes and errors follow the
torchgpipe documentation, with one change: without CUDA, ``devices`` defaults to CPU.
"""

from __future__ import annotations

import copy
import numbers
import weakref
from collections import OrderedDict
from types import TracebackType
from typing import Any, Iterable, Iterator, List, Optional, Tuple, Type, Union, cast

import torch
from torch import nn

from .errors import ChunksError, PipelinePicklingError, PlacementError
from .runtime import microbatch
from .runtime.batchnorm import (
    DeferredBatchNorm, commit_deferred_batch_norm, convert_deferred_batch_norm, defer_batch_norms,
    release_deferred_batch_norm,
)
from .runtime.pipeline import PipelineClosedError, PipelineRunner
from .skip.skippable import inspect_skip_layout, verify_skippables

__all__ = [
    "GPipe", "BalanceError", "PlacedModule", "checkpoint_stop", "check_chunks", "ChunksError",
    "PlacementError", "PipelineClosedError", "PipelinePicklingError",
]

Device = Union[torch.device, int, str]

CHECKPOINT_MODES = ("always", "except_last", "never")


def recommend_auto_balance(message: str) -> str:
    """Appends a hint about automatic balancing to a balance error."""
    return f"""{message}

If your model is still under development, its optimal balance would change
frequently. In this case, we highly recommend 'fxpipe.balance' for automatic
balancing:

  from fxpipe import GPipe
  from fxpipe.balance import balance_by_time

  partitions = torch.cuda.device_count()
  sample = torch.empty(...)
  balance = balance_by_time(partitions, model, sample)

  model = GPipe(model, balance, ...)

or let fxpipe.pipeline(model, sample, n_stages) trace and balance any module.
"""


class BalanceError(ValueError):
    pass


def verify_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned")
    named_children = list(module.named_children())
    if len(named_children) != len(module):
        raise ValueError("module with duplicate children is not supported")
    seen = {}
    for name, child in named_children:
        for param in child.parameters():
            other = seen.setdefault(id(param), name)
            if other != name:
                raise ValueError("module with duplicate parameters in distinct children is not supported")


def split_module(
    module: nn.Sequential, balance: Iterable[int], devices: List[torch.device],
) -> Tuple[List[nn.Sequential], List[int], List[torch.device]]:
    """Splits ``module`` by ``balance`` and moves each partition to its device."""
    balance = list(balance)
    if len(module) != sum(balance):
        raise BalanceError(
            "module and sum of balance have different length "
            f"(module: {len(module)}, sum of balance: {sum(balance)})"
        )
    if any(x <= 0 for x in balance):
        raise BalanceError(f"all balance numbers must be positive integer (balance: {balance!r})")
    if len(balance) > len(devices):
        raise IndexError(
            f"too few devices to hold given partitions (devices: {len(devices)}, partitions: {len(balance)})"
        )
    children = list(module.named_children())
    partitions: List[nn.Sequential] = []
    start = 0
    for size, device in zip(balance, devices):
        layers = OrderedDict(children[start:start + size])
        partitions.append(nn.Sequential(layers).to(device))
        start += size
    return partitions, balance, devices[: len(balance)]


def default_devices() -> List[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    # fxpipe's one change to torchgpipe: without CUDA, run on the CPU instead of failing.
    return [torch.device("cpu")] * 64


def checkpoint_stop(mode: str, num_microbatches: int, training: bool) -> int:
    """How many leading micro-batches are checkpointed (none in eval or under no_grad)."""
    if not (training and torch.is_grad_enabled()):
        return 0
    return {"always": num_microbatches, "except_last": num_microbatches - 1, "never": 0}[mode]


def check_chunks(chunks: object) -> int:
    """``chunks`` as an int; bools, fractions and values below 1 are refused."""
    if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise ChunksError(
            "number of chunks must be positive integer (chunks is the number of micro-batches "
            f"per mini-batch), got chunks={chunks!r}"
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
        # The copied layers arrive as plain BatchNorms (see runtime/batchnorm.py).
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


class GPipe(PlacedModule):
    """Wraps an ``nn.Sequential`` to train it with GPipe pipeline parallelism.

    Args:
        module: the sequential module to parallelize.
        balance: number of layers in each partition.
        devices: a device per partition (default: all CUDA devices, else CPU).
        chunks: number of micro-batches.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'``.
        deferred_batch_norm: track BatchNorm running statistics per mini-batch.

    Raises:
        TypeError: the module is not an ``nn.Sequential``.
        ValueError: invalid arguments, or a wrong balance.
        IndexError: fewer devices than partitions.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Iterable[int]] = None,
        *,
        devices: Optional[Iterable[Device]] = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        checkpoint = str(checkpoint)
        if balance is None:
            raise ValueError(recommend_auto_balance("balance is required"))
        self.chunks = chunks  # validated
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")

        verify_module(module)
        # Skips are static, so their integrity is checked before any forward.
        verify_skippables(module)

        self.checkpoint = checkpoint

        device_list = default_devices() if devices is None else [torch.device(d) for d in devices]
        try:
            partitions, self.balance, self.devices = split_module(module, balance, device_list)
        except BalanceError as exc:
            raise ValueError(recommend_auto_balance(str(exc))) from None
        self.partitions = cast(nn.ModuleList, nn.ModuleList(partitions))
        self._skip_layout = inspect_skip_layout(partitions)
        runtime = PipelineRunner(list(self.partitions), self.devices, skip_layout=self._skip_layout)
        self._open(runtime, self.partitions, deferred_batch_norm)

    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} layers")
        if index < 0:
            index += len(self)
        for partition in self.partitions:
            if index < len(partition):
                return partition[index]
            index -= len(partition)
        raise IndexError(index)  # unreachable

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    def forward(self, input: microbatch.TensorOrTensors) -> microbatch.TensorOrTensors:  # type: ignore[override]
        """Runs a mini-batch (a tensor or a tuple of tensors) through the pipeline."""
        self._runtime.check_open()
        microbatch.check(input)
        if not self.devices:
            return input
        batches = microbatch.scatter(input, self.chunks)
        stop = checkpoint_stop(self.checkpoint, len(batches), self.training)
        self._runtime.run(batches, stop)
        if self.training:
            commit_deferred_batch_norm(self._deferred)
        return microbatch.gather(batches)
