"""A step's target per micro-batch: split like the batch, and given to ``loss_fn`` as copies.

``pipe.step(x, loss_fn=..., target=y)`` (both front doors) calls ``loss_fn`` once per
micro-batch with that micro-batch's part of ``target``.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["TargetCopies", "split_target"]


class TargetCopies:
    """A micro-batch's target given to ``loss_fn`` as copies of the caller's pieces, and what
    ``loss_fn`` writes into them written back after the step.

    Why: the pieces :func:`split_target` makes are views of the caller's target and share its
    version counter, so a ``loss_fn`` writing its target in place (``y.add_(1)``) made a backward
    that runs after every micro-batch's loss (GPipe's step) fail in autograd on the earlier
    micro-batches' saved targets. Written back once the step is done, the caller's target holds
    the writes, as after eager's one call."""

    def __init__(self) -> None:
        self._given: List[Tuple[Tensor, Tensor, int]] = []  # (the piece, its copy, the copy's version)

    def __call__(self, part: Any) -> Any:
        def own(x: Any) -> Any:
            if not isinstance(x, Tensor):
                return x
            copy = x.clone()
            self._given.append((x, copy, copy._version))
            return copy
        return pytree.tree_map(own, part)

    def forget(self) -> None:
        """The copies dropped, the caller's target left as it was (``fxpipe.distributed``: only the
        last stage's rank runs ``loss_fn``, and every rank's target must stay alike)."""
        self._given.clear()

    def write_back(self) -> None:
        with torch.no_grad():
            for piece, copy, version in self._given:
                if copy._version != version:
                    piece.copy_(copy)
        self._given.clear()


def split_target(target: Any, sizes: Sequence[int]) -> List[Any]:
    """``target`` per micro-batch of ``sizes`` samples: a tensor, or a tuple, list or dict of
    them (``(labels, weights)``, ``{'labels': ..., 'mask': ...}``), each tensor split along
    dim 0; other values, 0-dim tensors among them (transformers' ``num_items_in_batch``), given
    whole to every micro-batch. A typed refusal names the leaf whose
    dim 0 is not the batch."""
    from ..errors import ArgumentError

    leaves, spec = pytree.tree_flatten_with_path(target)
    if not any(isinstance(x, Tensor) for _, x in leaves):
        raise ArgumentError(f"target must be a tensor with the batch along dim 0, or a tuple, list or dict of such "
                            f"tensors (each is split into micro-batches like the inputs), got {type(target).__name__}",
                            argument="target")
    total = sum(sizes)
    parts: List[List[Any]] = [[] for _ in sizes]
    for path, x in leaves:
        if isinstance(x, Tensor) and (x.dim() > 0 or len(leaves) == 1):
            name = "target" + pytree.keystr(path)
            if x.dim() == 0 or x.size(0) != total:
                got = "a 0-dim tensor" if x.dim() == 0 else f"{x.size(0)} samples along dim 0"
                raise ArgumentError(f"{name} has {got}, but the batch has {total} (target is split along dim 0 like "
                                    "the inputs)", argument="target")
            for part, piece in zip(parts, x.split(list(sizes), dim=0)):
                part.append(piece)
        else:
            for part in parts:
                part.append(x)
    treespec = pytree.tree_structure(target)
    return [pytree.tree_unflatten(part, treespec) for part in parts]
