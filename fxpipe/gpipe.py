"""``fxpipe.GPipe``: the torchgpipe-compatible front end for ``nn.Sequential``.

It splits the sequential module by ``balance``, places each partition on its device, and
runs micro-batches through the shared runtime. Behaviour, attributes and errors follow the
torchgpipe documentation, with one change: without CUDA, ``devices`` defaults to CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator, List, Optional, Tuple, cast

import torch
from torch import nn

from .runtime._devices import default_devices
from .errors import ChunksError, PipelinePicklingError, PlacementError
from .runtime._frontend import CHECKPOINT_MODES, Device, PlacedModule, checkpoint_stop
from .runtime import _microbatch as microbatch
from .runtime._batchnorm import commit_deferred_batch_norm, deferring
from .runtime._pipeline import PipelineClosedError, PipelineRunner
from .skip.skippable import inspect_skip_layout, verify_skippables

# The errors a GPipe user catches stay importable from here, as in torchgpipe.
__all__ = [
    "GPipe", "BalanceError", "ChunksError", "PlacementError", "PipelineClosedError", "PipelinePicklingError",
]


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

        balance = list(balance)
        device_list = (default_devices(len(balance), one_stage_per_gpu=True) if devices is None
                       else [torch.device(d) for d in devices])
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
        with deferring(self._deferred):
            self._runtime.run(batches, stop)
        if self.training:
            commit_deferred_batch_norm(self._deferred, len(batches), self.partitions)
        return microbatch.gather(batches)
