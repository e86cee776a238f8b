"""Micro-batches: splitting a mini-batch and putting the outputs back together.

Two shapes of input are handled:

* the torchgpipe shape, a tensor or a tuple of tensors (``scatter`` / ``gather``), which
  ``fxpipe.GPipe`` uses, and
* arbitrary pytrees of positional and keyword arguments (``scatter_tree`` /
  ``gather_tree``), which the ``fxpipe.pipeline`` front end uses: tensor leaves are split
  along dim 0, everything else is handed to every micro-batch unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..tree import flatten_values, unflatten_values

__all__ = ["Batch", "check", "scatter", "gather", "scatter_tree", "gather_tree", "TensorOrTensors",
           "flatten_values", "unflatten_values"]

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]


class Batch:
    """The values flowing through one micro-batch at one point of the pipeline.

    ``atomic`` remembers whether the values came from a single tensor (torchgpipe's
    convention) so outputs keep their shape. Values may be non-tensors (flags, ``None``);
    only tensors are copied between devices or carry autograd dependencies.
    """

    __slots__ = ("values", "atomic", "carry")

    def __init__(self, value: Any, atomic: bool | None = None) -> None:
        if atomic is None:
            atomic = not isinstance(value, tuple)
        self.atomic = atomic
        self.values: List[Any] = [value] if atomic else list(value)
        # A phony carrying the autograd dependencies of portals (stash and copy phonies)
        # from stage to stage, beside the values rather than joined to one: the next stage
        # may use a value only for its shape, or not at all, and the dependency would die
        # with it. Never passed to a partition: each stage's output takes over its input's
        # carry (runtime/_pipeline.py), checkpointing keeps it, and the pops of generated
        # code depend on it (runtime/_stage_portals.py).
        self.carry: Optional[Tensor] = None

    @property
    def value(self) -> Any:
        """The single tensor of an atomic batch, or the tuple of values."""
        return self.values[0] if self.atomic else tuple(self.values)

    def call(self, function: Callable[..., Any], *, spread: bool = False) -> "Batch":
        """Calls ``function`` on the values and wraps its result as a batch.

        ``spread=False`` passes one argument (a tensor or a tuple), as ``nn.Sequential``
        layers expect; ``spread=True`` passes each value as its own positional argument, as
        generated stage code expects.
        """
        if spread and not self.atomic:
            return Batch(function(*self.values))
        return Batch(function(self.value))

    def tensors(self) -> List[Tensor]:
        """Every tensor of the batch, also those inside tuples, lists and dicts (a value such
        as ``x.split(...)``'s result may cross a stage whole)."""
        leaves, _ = flatten_values(self.values)
        return [v for v in leaves if isinstance(v, Tensor)]

    def set_tensors(self, tensors: Sequence[Tensor]) -> None:
        """Replaces the tensors returned by :meth:`tensors`, in order, in place."""
        leaves, spec = flatten_values(self.values)
        it = iter(tensors)
        self.values = unflatten_values([next(it) if isinstance(v, Tensor) else v for v in leaves], spec)

    def anchor(self) -> int | None:
        """Index of the tensor that carries phony dependencies for this batch.

        The first floating-point (or complex) tensor that requires grad, else the first
        floating-point one (the only kinds that can carry gradients); None when there is
        none. One that requires grad is preferred because joining a phony that requires
        grad onto a tensor that did not would make it require grad: the next stage would
        see the model's input, or a value made from buffers, needing a gradient that eager
        never computes (and compute it, and keep it alive, for nothing).
        """
        first = None
        for i, v in enumerate(self.values):
            if isinstance(v, Tensor) and (v.is_floating_point() or v.is_complex()):
                if v.requires_grad:
                    return i
                if first is None:
                    first = i
        return first

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> Any:
        return self.values[index]

    def __setitem__(self, index: int, value: Any) -> None:
        self.values[index] = value

    def __repr__(self) -> str:
        return f"Batch[atomic={self.atomic}]({self.values!r})"


def check(input: Any) -> None:
    """Raises TypeError unless ``input`` is a tensor or a tuple of tensors (GPipe's rule)."""
    if isinstance(input, tuple):
        for x in input:
            check(x)
        return
    if not isinstance(input, Tensor):
        raise TypeError(f"expected Tensor or Tuple[Tensor, ...], but got {type(input).__name__}")


def split_sizes(total: int, chunks: int) -> List[int]:
    """Chunk sizes exactly like ``torch.chunk``: ceil-sized chunks, fewer when short."""
    if total == 0:
        return [0]
    size = -(-total // chunks)
    sizes = [size] * (total // size)
    if total % size:
        sizes.append(total % size)
    return sizes


def scatter(input: TensorOrTensors, chunks: int) -> List[Batch]:
    """Splits a tensor or a tuple of tensors into micro-batches along dim 0."""
    if isinstance(input, Tensor):
        return [Batch(x) for x in input.chunk(chunks)]
    _check_batch_sizes([(f"input[{i}]", x) for i, x in enumerate(input)])
    rotated = [x.chunk(chunks) for x in input]
    return [Batch(values) for values in zip(*rotated)]


def gather(outputs: Sequence[Batch]) -> TensorOrTensors:
    """Concatenates micro-batch outputs back into one mini-batch."""
    if outputs[0].atomic:
        return torch.cat([b.value for b in outputs])
    columns = zip(*[b.values for b in outputs])
    return tuple(torch.cat(column) for column in columns)


def _check_batch_sizes(named: Sequence[Tuple[str, Tensor]]) -> int:
    sizes = {name: x.size(0) for name, x in named if x.dim() > 0}
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{name} has {size}" for name, size in sizes.items())
        raise ValueError(
            f"tensor inputs must share one batch size along dim 0 to be split into micro-batches: {listing}"
        )
    return next(iter(sizes.values()), 0)


def scatter_tree(args: tuple, kwargs: dict, chunks: int) -> Tuple[List[List[Any]], pytree.TreeSpec]:
    """Splits every tensor leaf of ``(args, kwargs)`` along dim 0.

    Returns per micro-batch the flat list of leaves, and the spec to rebuild them. 0-dim
    tensors and non-tensor leaves go to every micro-batch unchanged. A batch with fewer
    samples than ``chunks`` gives fewer micro-batches, as ``torch.chunk`` does.
    """
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    named = [(pytree.keystr(path), v) for path, v in leaves if isinstance(v, Tensor)]
    batch_size = _check_batch_sizes(named)
    sizes = split_sizes(batch_size, chunks) if named else [0]
    micro: List[List[Any]] = [[] for _ in sizes]
    for _, value in leaves:
        if isinstance(value, Tensor) and value.dim() > 0:
            for m, part in zip(micro, value.split(sizes)):
                m.append(part)
        else:
            for m in micro:
                m.append(value)
    return micro, spec


def gather_tree(outputs: Sequence[Sequence[Any]], names: Sequence[str] | None = None) -> List[Any]:
    """Concatenates per micro-batch flat outputs leaf by leaf.

    Tensor leaves are concatenated along dim 0; other leaves are taken from the first
    micro-batch. A 0-dim tensor (say, a loss computed inside the model) cannot be
    regathered into the full batch's value, so it is refused with a ValueError.
    """
    gathered: List[Any] = []
    for i, column in enumerate(zip(*outputs)):
        first = column[0]
        if isinstance(first, Tensor):
            if first.dim() == 0:
                name = names[i] if names else f"output leaf {i}"
                raise ValueError(
                    f"{name} is a 0-dim tensor; per micro-batch scalars (a loss, a mean) cannot be "
                    "regathered into the mini-batch's value. Return per-sample values and reduce "
                    "outside the pipeline."
                )
            gathered.append(torch.cat(column) if len(column) > 1 else first)
        else:
            gathered.append(first)
    return gathered
